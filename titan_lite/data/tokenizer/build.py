"""The chooser: which back end reads a tokenizer path (a tokenizer.json, a tokenizer.model, or a folder of them)."""

from __future__ import annotations

from pathlib import Path

from titan_lite.data.tokenizer.base import Tokenizer
from titan_lite.data.tokenizer.byte_fallback import HFByteFallbackBPETokenizer
from titan_lite.data.tokenizer.byte_level import HFByteLevelBPETokenizer
from titan_lite.data.tokenizer.hf_json import read_json
from titan_lite.data.tokenizer.sentencepiece_model import SentencePieceTokenizer, load_sentencepiece
from titan_lite.data.tokenizer.tiktoken_model import TiktokenTokenizer, parse_tiktoken_file
from titan_lite.errors import ConfigError


def build_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at `path`: a tokenizer.json / tokenizer.model file, or a folder holding one
    (tokenizer.json preferred; a folder whose tokenizer.json is not byte-level BPE falls back to tokenizer.model)."""
    target = Path(path)
    if target.is_dir():
        return _build_from_folder(target)
    if not target.is_file():
        raise ConfigError(f"tokenizer path '{path}' does not exist (expected a tokenizer.json or tokenizer.model "
                          f"file, or a folder holding one)")
    if target.suffix == ".json":
        return _build_from_json(target)
    return _build_from_model_file(target)


def _build_from_json(path: Path) -> Tokenizer:
    """The tokenizer.json's kind: byte fallback over characters (Llama 2, Mistral), else byte-level BPE."""
    spec = read_json(path)
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    return (HFByteFallbackBPETokenizer if model.get("byte_fallback") else HFByteLevelBPETokenizer)(path)


def _build_from_folder(folder: Path) -> Tokenizer:
    hf_file, model_file = folder / "tokenizer.json", folder / "tokenizer.model"
    if hf_file.is_file():
        try:
            return _build_from_json(hf_file)
        except ConfigError:
            if not model_file.is_file():
                raise
    if model_file.is_file():
        return _build_from_model_file(model_file)
    raise ConfigError(f"tokenizer folder '{folder}' holds neither tokenizer.json nor tokenizer.model")


def _build_from_model_file(path: Path) -> Tokenizer:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"tokenizer file '{path}' cannot be read ({err.strerror})") from None
    ranks = parse_tiktoken_file(data)
    if ranks is not None:
        return TiktokenTokenizer(path, ranks)
    processor = load_sentencepiece(data)
    if processor is not None:
        return SentencePieceTokenizer(processor, path)
    raise ConfigError(f"tokenizer file '{path}' is neither a tiktoken file ('<base64> <rank>' lines) "
                      f"nor a sentencepiece model")

