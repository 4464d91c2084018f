"""The tokenizers, one module per back end: Llama 3 tiktoken files, sentencepiece models and HF tokenizer.json BPE
files (byte-level, as Llama 3 and Qwen write them; or over characters with byte fallback and '▁' for spaces, as
Llama 2 and Mistral do). Import them from here."""

from titan_lite.data.tokenizer.base import Tokenizer, describe_tokenizer, tokenizer_fingerprint
from titan_lite.data.tokenizer.build import build_tokenizer
from titan_lite.data.tokenizer.byte_fallback import HFByteFallbackBPETokenizer
from titan_lite.data.tokenizer.byte_level import HFByteLevelBPETokenizer, byte_level_alphabet
from titan_lite.data.tokenizer.regex import compile_pattern, translate_regex
from titan_lite.data.tokenizer.sentencepiece_model import SentencePieceTokenizer
from titan_lite.data.tokenizer.tiktoken_model import (
    LLAMA3_PATTERN,
    NUM_LLAMA3_SPECIAL_TOKENS,
    TiktokenTokenizer,
    llama3_special_tokens,
    parse_tiktoken_file,
)

__all__ = [
    "LLAMA3_PATTERN", "NUM_LLAMA3_SPECIAL_TOKENS", "HFByteFallbackBPETokenizer", "HFByteLevelBPETokenizer",
    "SentencePieceTokenizer", "TiktokenTokenizer", "Tokenizer", "build_tokenizer", "byte_level_alphabet",
    "compile_pattern", "describe_tokenizer", "llama3_special_tokens", "parse_tiktoken_file", "tokenizer_fingerprint",
    "translate_regex",
]
