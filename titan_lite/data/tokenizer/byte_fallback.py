"""HF tokenizer.json BPE over characters with byte fallback and '▁' for spaces, as converted from sentencepiece
(Llama 2, Mistral, Gemma)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from titan_lite.data.tokenizer.bpe_core import merge_symbols
from titan_lite.data.tokenizer.byte_level import HFByteLevelBPETokenizer
from titan_lite.data.tokenizer.hf_json import bpe_vocab, build_normalizer, merge_options
from titan_lite.errors import ConfigError

BYTE_TOKEN = re.compile(r"<0x([0-9A-F]{2})>")


class HFByteFallbackBPETokenizer(HFByteLevelBPETokenizer):
    """A HF `tokenizer.json` BPE over characters with byte fallback, as converted from sentencepiece (Llama 2, Mistral
    v0.1 and v0.3): spaces become '▁', marked at the start either by a Prepend + Replace normalizer (one '▁' before
    every piece between added tokens) or by a Metaspace pre-tokenizer (prepend_scheme first / always / never); a
    character outside the vocab becomes the <0xXX> tokens of its UTF-8 bytes (or <unk> without them)."""

    _CACHE_WORD_LIMIT = 256  # longer words (a Prepend normalizer leaves whole documents as one word) are not cached
    backend = "python BPE (byte fallback)"

    def _start_core(self, path: Path, spec: dict[str, Any], checked: bool) -> None:
        """tiktoken's core merges bytes, not characters: this BPE stays in Python."""

    def _load_text_pipeline(self, path: Path, spec: dict[str, Any]) -> None:
        self._specs = {name: spec.get(name) for name in ("normalizer", "pre_tokenizer")}
        self._normalize = build_normalizer(path, spec.get("normalizer"))
        pre = spec.get("pre_tokenizer")
        self._metaspace, self._prepend_scheme, self._split = None, "never", False
        normalizers = _flat_normalizers(spec.get("normalizer"))
        if pre and _splits_only_replaced_spaces(pre, normalizers):
            pre = None  # Gemma's: a Split on " " after the normalizer replaced every " " has nothing to split
        if pre:
            if pre.get("type") != "Metaspace":
                raise ConfigError(f"tokenizer file '{path}': pre-tokenizer {pre.get('type')!r} is not supported with "
                                  "byte_fallback (none or Metaspace)")
            self._metaspace = str(pre.get("replacement", "▁"))
            scheme = pre.get("prepend_scheme") or ("always" if pre.get("add_prefix_space", True) else "never")
            if scheme not in ("first", "always", "never"):
                raise ConfigError(f"tokenizer file '{path}': Metaspace prepend_scheme {scheme!r} is not supported")
            self._prepend_scheme, self._split = scheme, bool(pre.get("split", True))
        self._strips_leading_space = self._prepend_scheme != "never" or any(
            n.get("type") == "Prepend" for n in normalizers)

    def _load_model(self, path: Path, model: dict[str, Any]) -> None:
        vocab = bpe_vocab(path, model)
        self._token_ids = dict(vocab)
        self._piece_ids = dict(vocab)
        self._byte_ids = {int(m.group(1), 16): i for tok, i in vocab.items() if (m := BYTE_TOKEN.fullmatch(tok))}
        self._id_to_bytes = {i: self._piece_bytes(tok) for tok, i in vocab.items()}
        self._merges = _char_merges(path, model.get("merges") or [], vocab)
        self._ignore_merges, self._unk_id = merge_options(model, vocab)
        self._fuse_unk = bool(model.get("fuse_unk", False))

    def _piece_bytes(self, token: str) -> bytes:
        match = BYTE_TOKEN.fullmatch(token)
        return bytes([int(match.group(1), 16)]) if match else token.replace("▁", " ").encode("utf-8")

    # -- encoding

    def _encode_text(self, text: str, allow_special: bool) -> list[int]:
        matcher = self._added_all if allow_special else self._added_plain
        if matcher is None:
            return self._encode_segment(text, at_start=True)
        ids: list[int] = []
        position = 0
        for piece, added_id in matcher.split(text):
            ids.extend([added_id] if added_id is not None else self._encode_segment(piece, at_start=position == 0))
            position += len(piece)
        return ids

    def _encode_segment(self, text: str, at_start: bool = True) -> list[int]:
        text = self._normalize(text)
        if not text:
            return []
        words = [text]
        if self._metaspace is not None:
            text = text.replace(" ", self._metaspace)
            prepend = self._prepend_scheme == "always" or (self._prepend_scheme == "first" and at_start)
            if prepend and not text.startswith(self._metaspace):
                text = self._metaspace + text
            words = _split_before(text, self._metaspace) if self._split else [text]
        ids: list[int] = []
        for word in words:
            ids.extend(self._word_ids(word))
        return ids

    def _bpe(self, word: str) -> list[int]:
        if self._ignore_merges and word in self._piece_ids:
            return [self._piece_ids[word]]
        return merge_symbols(self._initial_symbols(word), self._merges)

    def _initial_symbols(self, word: str) -> list[int]:
        """One id per character in the vocab; its bytes' <0xXX> ids for one that is not (when all exist), else <unk>
        (consecutive ones fused into one with fuse_unk)."""
        symbols: list[int] = []
        unk_open = False
        for ch in word:
            tid = self._piece_ids.get(ch)
            if tid is not None:
                symbols.append(tid)
                unk_open = False
                continue
            raw = ch.encode("utf-8")
            if self._byte_ids and all(b in self._byte_ids for b in raw):
                symbols.extend(self._byte_ids[b] for b in raw)
                unk_open = False
            elif self._unk_id is not None:
                if not (unk_open and self._fuse_unk):
                    symbols.append(self._unk_id)
                unk_open = True
        return symbols

    def decode(self, ids: list[int]) -> str:
        text = b"".join(self._id_to_bytes[i] for i in ids).decode("utf-8", errors="replace")
        return text[1:] if self._strips_leading_space and text.startswith(" ") else text


def _flat_normalizers(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [n for sub in spec.get("normalizers") or [] for n in _flat_normalizers(sub)]
    return [spec]


def _splits_only_replaced_spaces(pre: dict[str, Any], normalizers: list[dict[str, Any]]) -> bool:
    """A Split pre-tokenizer on the string " " (Gemma's tokenizer.json: merged_with_previous) behind a normalizer
    that replaces every " " by another string: no space is left to split on."""
    replaced = any(n.get("type") == "Replace" and n.get("pattern") == {"String": " "} and n.get("content") != " "
                   for n in normalizers)
    return replaced and pre.get("type") == "Split" and pre.get("pattern") == {"String": " "} and \
        not pre.get("invert", False)


def _split_before(text: str, marker: str) -> list[str]:
    """Metaspace's split: a new word starts at every marker (the marker stays with the word it starts)."""
    words, start = [], 0
    for i, ch in enumerate(text):
        if ch == marker and i > start:
            words.append(text[start:i])
            start = i
    words.append(text[start:])
    return [w for w in words if w]


def _char_merges(path: Path, merges: list[Any], vocab: dict[str, int]) -> dict[tuple[int, int], tuple[int, int]]:
    """(left id, right id) -> (rank, merged id) of a character-level BPE's merge list."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if len(pair) != 2 or any(side not in vocab for side in pair) or pair[0] + pair[1] not in vocab:
            raise ConfigError(f"tokenizer file '{path}': merge #{rank} {merge!r} is not a pair of vocab tokens whose "
                              "join is in the vocab")
        out.setdefault((vocab[pair[0]], vocab[pair[1]]), (rank, vocab[pair[0] + pair[1]]))
    return out

