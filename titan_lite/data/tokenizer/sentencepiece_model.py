"""Sentencepiece `tokenizer.model` files (Llama 2 style), encoded by the sentencepiece library."""

from __future__ import annotations

from pathlib import Path

import sentencepiece

from titan_lite.data.tokenizer.base import Tokenizer
from titan_lite.data.tokenizer.regex import alternation_regex, split_on


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `tokenizer.model` (Llama 2 style); bos/eos/pad come from the model."""

    backend = "sentencepiece"
    releases_gil = True

    def __init__(self, processor: sentencepiece.SentencePieceProcessor, source: Path | None = None):
        self._sp = processor
        self.source = source
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id()
        controls = {self._sp.id_to_piece(i): i for i in range(self.vocab_size) if self._sp.is_control(i)}
        self._controls = {piece: i for piece, i in controls.items() if piece}
        self._control_regex = alternation_regex(list(self._controls))
        self.special_ids = frozenset(controls.values())

    def _encode_text(self, text: str, allow_special: bool) -> list[int]:
        if not allow_special or self._control_regex is None:
            return self._sp.encode(text)
        ids: list[int] = []
        for segment, is_control in split_on(self._control_regex, text):
            ids.extend([self._controls[segment]] if is_control else self._sp.encode(segment))
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


def load_sentencepiece(proto: bytes) -> sentencepiece.SentencePieceProcessor | None:
    """The sentencepiece model serialized in `proto`, or None when it is not one."""
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto)
    except Exception:  # noqa: BLE001 - sentencepiece raises RuntimeError or OSError depending on the failure
        return None
    return processor if processor.get_piece_size() > 0 else None

