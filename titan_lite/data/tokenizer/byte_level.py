"""HF tokenizer.json byte-level BPE (as Llama 3, Qwen and SmolLM write it), run on tiktoken's core where that is
exact, else by the merge list in Python; its pre-tokenizer steps."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tiktoken

from titan_lite.data.tokenizer.base import Tokenizer
from titan_lite.data.tokenizer.bpe_core import (
    GPT2_PATTERN,
    exact_ranks,
    missing_bytes,
    split_pattern,
    tiktoken_encoding,
)
from titan_lite.data.tokenizer.hf_json import (
    AddedTokenMatcher,
    bpe_vocab,
    build_normalizer,
    hf_tokenizer_config,
    merge_options,
    read_json,
    template_specials,
)
from titan_lite.data.tokenizer.regex import compile_pattern, split_on
from titan_lite.errors import ConfigError


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    for offset, b in enumerate(shifted):
        mapping[b] = chr(256 + offset)
    return mapping


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    return {ch: b for b, ch in byte_level_alphabet().items()}


def byte_level_to_bytes(token: str) -> bytes | None:
    """The bytes a byte-level vocab entry stands for, or None if it uses characters outside the alphabet."""
    decoder = _byte_level_decoder()
    if any(ch not in decoder for ch in token):
        return None
    return bytes(decoder[ch] for ch in token)


PreTokenizeStep = Callable[[str], list[str]]


class HFByteLevelBPETokenizer(Tokenizer):
    """A HF `tokenizer.json` byte-level BPE, run without the `tokenizers` library: added tokens are split out
    first, then normalizer -> pre-tokenizers -> BPE that merges by merge-list order (as `tokenizers` does)."""

    _CACHE_LIMIT = 200_000
    _CACHE_WORD_LIMIT: int | None = None  # longer words are not cached (None: every word is)
    _SEGMENT_CACHE_CHARS = 512  # longer stretches between added tokens are not cached

    backend = "python BPE"

    def __init__(self, path: Path, core: bool | None = None):
        """`core`: encode with tiktoken's core where it is exact (None: check whether it is; True: checked before,
        as when unpickled in a worker; False: never)."""
        spec = read_json(path)
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ConfigError(f"tokenizer file '{path}': model type is {model.get('type')!r}, expected a BPE model")
        self.source = path
        self._load_text_pipeline(path, spec)
        self._load_model(path, model)
        self._load_added_tokens(path, spec.get("added_tokens") or [])
        self._load_special_ids(path, spec.get("post_processor"))
        self._cache: dict[bytes, list[int]] = {}
        self._segments: dict[str, list[int]] = {}
        self._core: tiktoken.Encoding | None = None
        self._core_skips: re.Pattern[bytes] | None = None  # the bytes that send a text to the Python BPE
        if core is not False:
            self._start_core(path, spec, checked=bool(core))

    @property
    def releases_gil(self) -> bool:
        return self._core is not None  # the Python BPE holds the GIL throughout

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its text functions (workers started by spawn or forkserver build them again from the
        file's specs) and without its caches."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_steps", "_normalize", "_cache", "_segments")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _cache={}, _segments={})
        self._normalize = build_normalizer(self.source, self._specs["normalizer"])

    # -- loading

    def _load_text_pipeline(self, path: Path, spec: dict[str, Any]) -> None:
        self._specs = {name: spec.get(name) for name in ("normalizer", "pre_tokenizer")}
        self._steps = _pre_tokenizer_steps(path, spec.get("pre_tokenizer"))
        self._normalize = build_normalizer(path, spec.get("normalizer"))

    @property
    def _pre_steps(self) -> list[PreTokenizeStep]:
        if "_steps" not in self.__dict__:  # an unpickled copy builds them when it first needs them
            self._steps = _pre_tokenizer_steps(self.source, self._specs["pre_tokenizer"])
        return self._steps

    def _start_core(self, path: Path, spec: dict[str, Any], checked: bool) -> None:
        """Encode plain text with tiktoken's core when its ids are exactly the merge list's (bpe_core), and say in
        the log which back end runs."""
        pattern, self._prefix_space, why = split_pattern(_pre_tokenizer_specs(spec.get("pre_tokenizer")))
        ranks = None
        if pattern is not None:
            # added tokens (a trainer's special tokens sit in the vocab too) are split out before BPE runs
            plain = {raw: i for raw, i in self._vocab.items() if i not in self._added_ids}
            ranks, why = (plain, "") if checked else exact_ranks(plain, self._merge_ranks)
        if ranks is not None:
            try:
                self._core = tiktoken_encoding(path.name, pattern, ranks)
            except ValueError as err:  # a pattern tiktoken's regex engine does not take
                why = f"tiktoken cannot use the split pattern ({err})"
        if self._core is None:
            self.backend_note = f"tiktoken's core would not be exact: {why}"
            return
        self.backend, self.backend_note = "tiktoken", "tiktoken's core: ids in merge order, one split pattern"
        missing = missing_bytes(ranks)
        if missing:
            self._core_skips = re.compile(b"[" + b"".join(re.escape(bytes([b])) for b in missing) + b"]")
            self.backend_note += (f"; a text holding one of the {len(missing)} bytes the vocabulary lacks as tokens "
                                  f"({_byte_list(missing)}) is encoded in Python")

    def _load_model(self, path: Path, model: dict[str, Any]) -> None:
        vocab = bpe_vocab(path, model)
        self._token_ids: dict[str, int] = dict(vocab)
        self._vocab = {raw: i for tok, i in vocab.items() if (raw := byte_level_to_bytes(tok)) is not None}
        self._id_to_bytes = {i: raw for raw, i in self._vocab.items()}
        self._merge_ranks = _merge_ranks(path, model.get("merges") or [], self._vocab)
        self._ignore_merges, self._unk_id = merge_options(model, vocab)

    def _load_added_tokens(self, path: Path, added: list[dict[str, Any]]) -> None:
        for tok in added:
            content, tid = tok.get("content"), tok.get("id")
            if not isinstance(content, str) or not content or not isinstance(tid, int):
                raise ConfigError(f"tokenizer file '{path}': each added token needs a non-empty content and an id")
            self._token_ids[content] = tid
            self._id_to_bytes[tid] = content.encode("utf-8")
        # longest first: HF matches added tokens leftmost-longest
        by_length = sorted(added, key=lambda t: len(t["content"]), reverse=True)
        self._added_all = AddedTokenMatcher.build(by_length)
        self._added_plain = AddedTokenMatcher.build([t for t in by_length if not t.get("special", False)])
        self.special_ids = frozenset(t["id"] for t in added if t.get("special", False))
        self._added_ids = frozenset(t["id"] for t in added)
        self.vocab_size = max(self._token_ids.values(), default=-1) + 1

    def _load_special_ids(self, path: Path, post_processor: dict[str, Any] | None) -> None:
        config = hf_tokenizer_config(path.parent)
        template_prefix, template_suffix = template_specials(post_processor)
        self.bos_id = self._config_token_id(path, config, "bos_token", template_prefix)
        self.eos_id = self._config_token_id(path, config, "eos_token", template_suffix)
        self.pad_id = self._config_token_id(path, config, "pad_token", -1)
        add_bos = config.get("add_bos_token")
        self.add_bos = bool(add_bos) if isinstance(add_bos, bool) else template_prefix >= 0
        if self.add_bos and self.bos_id < 0:
            raise ConfigError(f"tokenizer '{path}': add_bos_token is set but no bos_token is defined")

    def _config_token_id(self, path: Path, config: dict[str, Any], key: str, default: int) -> int:
        value = config.get(key)
        content = value.get("content") if isinstance(value, dict) else value
        if not isinstance(content, str):
            return default
        if content not in self._token_ids:
            raise ConfigError(f"tokenizer '{path}': {key} {content!r} from tokenizer_config.json is not in the vocab")
        return self._token_ids[content]

    # -- encoding

    def encode(self, text: str, bos: bool = True, eos: bool = False, *, allow_special: bool = False) -> list[int]:
        """`bos=True` adds BOS only when the tokenizer adds one (add_bos_token or its post_processor template)."""
        return super().encode(text, bos=bos and self.add_bos, eos=eos, allow_special=allow_special)

    def _encode_text(self, text: str, allow_special: bool) -> list[int]:
        matcher = self._added_all if allow_special else self._added_plain
        if matcher is None:
            return self._encode_segment(text)
        ids: list[int] = []
        for piece, added_id in matcher.split(text):
            ids.extend([added_id] if added_id is not None else self._cached_segment(piece))
        return ids

    def _cached_segment(self, text: str) -> list[int]:
        """A short stretch between added tokens (a chat turn's role line, a turn encoded again to find its tokens)
        from the cache when it was encoded before."""
        if len(text) > self._SEGMENT_CACHE_CHARS:
            return self._encode_segment(text)
        ids = self._segments.get(text)
        if ids is None:
            if len(self._segments) >= self._CACHE_LIMIT:
                self._segments.clear()
            ids = self._segments[text] = self._encode_segment(text)
        return ids

    def _encode_segment(self, text: str) -> list[int]:
        text = self._normalize(text)
        if self._core is not None and (self._core_skips is None or not self._core_skips.search(_utf8(text))):
            if self._prefix_space and not text.startswith(" "):
                text = " " + text
            return self._core.encode_ordinary(text)
        pieces = [text]
        for step in self._pre_steps:
            pieces = [out for piece in pieces for out in step(piece) if out]
        ids: list[int] = []
        for piece in pieces:
            ids.extend(self._word_ids(piece.encode("utf-8")))
        return ids

    def _word_ids(self, word: bytes | str) -> list[int]:
        if self._CACHE_WORD_LIMIT is not None and len(word) > self._CACHE_WORD_LIMIT:
            return self._bpe(word)
        ids = self._cache.get(word)
        if ids is None:
            if len(self._cache) >= self._CACHE_LIMIT:
                self._cache.clear()
            ids = self._cache[word] = self._bpe(word)
        return ids

    def _bpe(self, word: bytes) -> list[int]:
        """Merge the lowest-ranked adjacent pair (leftmost on ties) until none is in the merge list."""
        if self._ignore_merges and word in self._vocab:
            return [self._vocab[word]]
        parts = [word[i:i + 1] for i in range(len(word))]
        while len(parts) > 1:
            best_rank, best_at = None, -1
            for i in range(len(parts) - 1):
                rank = self._merge_ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_at = rank, i
            if best_rank is None:
                break
            parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
        return [tid for part in parts if (tid := self._vocab.get(part, self._unk_id)) is not None]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._id_to_bytes[i] for i in ids).decode("utf-8", errors="replace")



def _utf8(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogatepass")


def _byte_list(values: list[int]) -> str:
    """4, 6, 245-255: runs of consecutive values shown as ranges."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _merge_ranks(path: Path, merges: list[Any], vocab: dict[bytes, int]) -> dict[tuple[bytes, bytes], int]:
    ranks: dict[tuple[bytes, bytes], int] = {}
    for rank, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        raw = [byte_level_to_bytes(side) if isinstance(side, str) else None for side in pair]
        if len(raw) != 2 or None in raw or raw[0] not in vocab or raw[1] not in vocab or raw[0] + raw[1] not in vocab:
            raise ConfigError(f"tokenizer file '{path}': merge #{rank} {merge!r} is not a pair of byte-level vocab "
                              f"tokens whose join is in the vocab")
        ranks.setdefault((raw[0], raw[1]), rank)
    return ranks



def _pre_tokenizer_specs(spec: dict[str, Any] | None) -> list[dict[str, Any] | None]:
    """The steps of a pre_tokenizer (a Sequence's, or the one)."""
    return (spec.get("pretokenizers") or []) if spec and spec.get("type") == "Sequence" else [spec]


def _pre_tokenizer_steps(path: Path, spec: dict[str, Any] | None) -> list[PreTokenizeStep]:
    """The pre-tokenizer as a list of piece-splitting steps; the last one must be ByteLevel."""
    specs = _pre_tokenizer_specs(spec)
    if not specs or not specs[-1] or specs[-1].get("type") != "ByteLevel":
        raise ConfigError(f"tokenizer file '{path}': not a byte-level BPE (the pre_tokenizer must end with ByteLevel)")
    return [_pre_tokenizer_step(path, sub) for sub in specs]


def _pre_tokenizer_step(path: Path, spec: dict[str, Any]) -> PreTokenizeStep:
    kind = spec.get("type")
    try:
        if kind == "ByteLevel":
            return _byte_level_step(bool(spec.get("add_prefix_space", True)), bool(spec.get("use_regex", True)))
        if kind == "Split":
            return _split_step(path, spec)
        if kind == "Digits":
            # a digit is any Unicode number (Rust's char::is_numeric), as `tokenizers` splits them
            regex = compile_pattern(r"\p{N}" if spec.get("individual_digits") else r"\p{N}+")
            return lambda piece: [p for p, _ in split_on(regex, piece)]
    except (ValueError, re.error) as err:
        raise ConfigError(f"tokenizer file '{path}': cannot use the {kind} pre-tokenizer pattern ({err})") from None
    raise ConfigError(f"tokenizer file '{path}': pre-tokenizer {kind!r} is not supported (ByteLevel, Split, Digits)")


def _byte_level_step(add_prefix_space: bool, use_regex: bool) -> PreTokenizeStep:
    regex = compile_pattern(GPT2_PATTERN) if use_regex else None

    def step(piece: str) -> list[str]:
        if add_prefix_space and not piece.startswith(" "):
            piece = " " + piece
        return [p for p, _ in split_on(regex, piece)] if regex is not None else [piece]

    return step


def _split_step(path: Path, spec: dict[str, Any]) -> PreTokenizeStep:
    pattern = spec.get("pattern") or {}
    if "Regex" in pattern:
        regex = compile_pattern(pattern["Regex"])
    elif "String" in pattern:
        regex = re.compile(re.escape(pattern["String"]))
    else:
        raise ConfigError(f"tokenizer file '{path}': Split pre-tokenizer without a Regex or String pattern")
    behavior = str(spec.get("behavior", "Isolated")).lower()
    if spec.get("invert") or behavior not in ("isolated", "removed"):
        raise ConfigError(f"tokenizer file '{path}': Split behavior {spec.get('behavior')!r} "
                          f"(invert={spec.get('invert')}) is not supported (Isolated or Removed)")
    keep_matches = behavior == "isolated"
    return lambda piece: [p for p, matched in split_on(regex, piece) if keep_matches or not matched]

