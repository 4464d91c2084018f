"""The tokenizer interface every back end implements, and what identifies a tokenizer's ids (the fingerprint token
files record, the line the run's log prints)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


class Tokenizer:
    """Text <-> ids. `encode` adds bos/eos when asked; special-token strings in the text stay plain text
    unless `allow_special=True`."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int = -1
    special_ids: frozenset[int] = frozenset()  # control tokens (what transformers' skip_special_tokens drops)
    backend: str  # what encodes: 'tiktoken', 'sentencepiece', 'python BPE'
    backend_note = ""  # why that one (a tokenizer.json byte-level BPE: whether tiktoken's core is exact for it)
    source: Path | None = None  # the file it was read from
    # whether encoding runs without Python's GIL (a library core), so threads encoding documents side by side scale
    releases_gil = False

    def encode(self, text: str, bos: bool = True, eos: bool = False, *, allow_special: bool = False) -> list[int]:
        ids = self._encode_text(text, allow_special)
        return self._add_bos_eos(ids, bos, eos)

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def _encode_text(self, text: str, allow_special: bool) -> list[int]:
        raise NotImplementedError

    def _add_bos_eos(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        prefix = [self.bos_id] if bos and self.bos_id >= 0 else []
        suffix = [self.eos_id] if eos and self.eos_id >= 0 else []
        return prefix + ids + suffix


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, Any]:
    """What identifies a tokenizer's ids: its file (name and SHA-256) and the special ids it adds (tokenizer_config.json
    may change those without touching the file). Token files record it; a run with another tokenizer is refused."""
    source = tokenizer.source
    data = source.read_bytes() if source is not None else tokenizer._sp.serialized_model_proto()
    return {"file": source.name if source is not None else "sentencepiece model",
            "sha256": hashlib.sha256(data).hexdigest(), "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id if getattr(tokenizer, "add_bos", True) else -1, "eos_id": tokenizer.eos_id,
            "pad_id": tokenizer.pad_id}


def describe_tokenizer(tokenizer: Tokenizer) -> str:
    """Which back end encodes, and why: for the run's log and DRY_RUN."""
    return tokenizer.backend + (f" ({tokenizer.backend_note})" if tokenizer.backend_note else "")
