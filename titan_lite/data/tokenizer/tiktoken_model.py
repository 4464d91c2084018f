"""Llama 3's tiktoken `tokenizer.model` files ("<base64 bytes> <rank>" lines): their ranks, regex and special tokens."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

import tiktoken

from titan_lite.data.tokenizer.base import Tokenizer
from titan_lite.errors import ConfigError

# Llama 3's pre-tokenizer split pattern (the cl100k pattern with numbers in groups of up to three).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
NUM_LLAMA3_SPECIAL_TOKENS = 256


def llama3_special_tokens(count: int = NUM_LLAMA3_SPECIAL_TOKENS) -> list[str]:
    """Llama 3's special tokens in their published order; they take the ids right after the base ranks."""
    named = [
        "<|begin_of_text|>", "<|end_of_text|>",
        "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
        "<|start_header_id|>", "<|end_header_id|>",
        "<|reserved_special_token_4|>", "<|eot_id|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, count - 5)]
    return named + reserved



class TiktokenTokenizer(Tokenizer):
    """A Llama 3 `tokenizer.model` (lines "<base64 bytes> <rank>") with Llama 3's regex and 256 special tokens."""

    backend = "tiktoken"
    releases_gil = True

    def __init__(self, path: Path, ranks: dict[bytes, int]):
        _check_tiktoken_ranks(path, ranks)
        self.source = path
        num_base = len(ranks)
        self.special_tokens = {tok: num_base + i for i, tok in enumerate(llama3_special_tokens())}
        self._encoding = tiktoken.Encoding(
            name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.vocab_size = num_base + len(self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.pad_id = -1
        self.special_ids = frozenset(self.special_tokens.values())

    def _encode_text(self, text: str, allow_special: bool) -> list[int]:
        if allow_special:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids))


def parse_tiktoken_file(data: bytes) -> dict[bytes, int] | None:
    """The ranks of a tiktoken file, or None when `data` is not one."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None
    ranks: dict[bytes, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit():
            return None
        try:
            ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
        except binascii.Error:
            return None
    return ranks or None


def _check_tiktoken_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"tokenizer file '{path}': tiktoken ranks must be 0..N-1, each used once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(f"tokenizer file '{path}': tiktoken file lacks {len(missing)} of the 256 single-byte tokens")

