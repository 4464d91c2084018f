"""Owns the tokenizers: Llama 3 tiktoken files, sentencepiece models and HF tokenizer.json BPE files (byte-level, as
Llama 3 and Qwen write them; or over characters with byte fallback and '▁' for spaces, as Llama 2 and Mistral do)."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sentencepiece
import tiktoken

from titan_lite.data.bpe_core import GPT2_PATTERN, exact_ranks, merge_symbols, split_pattern, tiktoken_encoding
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


# ---------------------------------------------------------------- the interface


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


# ---------------------------------------------------------------- Llama 3 tiktoken


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


# ---------------------------------------------------------------- sentencepiece


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
        self._control_regex = _alternation_regex(list(self._controls))
        self.special_ids = frozenset(controls.values())

    def _encode_text(self, text: str, allow_special: bool) -> list[int]:
        if not allow_special or self._control_regex is None:
            return self._sp.encode(text)
        ids: list[int] = []
        for segment, is_control in _split_on(self._control_regex, text):
            ids.extend([self._controls[segment]] if is_control else self._sp.encode(segment))
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


def _load_sentencepiece(proto: bytes) -> sentencepiece.SentencePieceProcessor | None:
    """The sentencepiece model serialized in `proto`, or None when it is not one."""
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto)
    except Exception:  # noqa: BLE001 - sentencepiece raises RuntimeError or OSError depending on the failure
        return None
    return processor if processor.get_piece_size() > 0 else None


# ---------------------------------------------------------------- regex translation


# Unicode White_Space, which is what \s means in the Rust and Oniguruma regex engines of tiktoken / tokenizers
# (Python's \s would also match the separators \x1c-\x1f).
_WHITESPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]
_LONG_PROPERTY_NAMES = {"Letter": "L", "Mark": "M", "Number": "N", "Punctuation": "P", "Symbol": "S",
                        "Separator": "Z", "Other": "C"}


@functools.lru_cache(maxsize=1)
def _category_spans() -> dict[str, list[tuple[int, int]]]:
    """Every code point range of each Unicode general category (Lu, Nd, ...)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    start, current = 0, unicodedata.category(chr(0))
    for cp in range(1, 0x110000):
        category = unicodedata.category(chr(cp))
        if category != current:
            spans.setdefault(current, []).append((start, cp - 1))
            start, current = cp, category
    spans.setdefault(current, []).append((start, 0x10FFFF))
    return spans


def _class_body(spans: list[tuple[int, int]]) -> str:
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in merged)


@functools.cache
def _property_body(name: str) -> str:
    name = _LONG_PROPERTY_NAMES.get(name, name)
    spans = _category_spans()
    chosen = [cat for cat in spans if cat == name or (len(name) == 1 and cat[0] == name)]
    if not chosen:
        raise ValueError(f"unsupported Unicode property \\p{{{name}}}")
    return _class_body([span for cat in chosen for span in spans[cat]])


def _read_property_name(pattern: str, start: int) -> tuple[str, int]:
    """The name after \\p or \\P and the index just past it (\\pL or \\p{Lu})."""
    if pattern[start:start + 1] == "{":
        end = pattern.index("}", start)
        return pattern[start + 1:end], end + 1
    return pattern[start:start + 1], start + 1


def _class_piece(body: str, negated: bool, in_class: bool) -> str:
    if not in_class:
        return f"[{'^' if negated else ''}{body}]"
    if negated:
        raise ValueError("a negated class (\\P{..} or \\S) inside [...] is not supported")
    return body


def translate_regex(pattern: str) -> str:
    """Rewrite a tiktoken/Oniguruma pattern for Python's `re`: \\p{..}, \\P{..}, \\s and \\S become explicit
    code point classes (Python's `re` has no \\p and a slightly different \\s)."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            kind = pattern[i + 1]
            if kind in "pP":
                name, i = _read_property_name(pattern, i + 2)
                out.append(_class_piece(_property_body(name), kind == "P", in_class))
                continue
            if kind in "sS":
                out.append(_class_piece(_class_body(_WHITESPACE), kind == "S", in_class))
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        out.append(ch)
        i += 1
        if ch == "[" and not in_class:
            in_class = True
            if pattern[i:i + 1] == "^":
                out.append("^")
                i += 1
            if pattern[i:i + 1] == "]":  # a ']' first in a class is a literal
                out.append("\\]")
                i += 1
        elif ch == "]" and in_class:
            in_class = False
    return "".join(out)


@functools.cache
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A tiktoken/Oniguruma pre-tokenizer pattern compiled with Python's `re`."""
    return re.compile(translate_regex(pattern))


def _alternation_regex(literals: list[str]) -> re.Pattern[str] | None:
    """Matches any of `literals`, longest first (like the leftmost-longest matching of HF added tokens)."""
    if not literals:
        return None
    return re.compile("|".join(re.escape(lit) for lit in sorted(literals, key=len, reverse=True)))


def _split_on(regex: re.Pattern[str], text: str) -> Iterator[tuple[str, bool]]:
    """(piece, matched) for the matches of `regex` and the non-empty gaps between them, in order."""
    pos = 0
    for match in regex.finditer(text):
        if match.start() > pos:
            yield text[pos:match.start()], False
        if match.end() > match.start():
            yield match.group(), True
        pos = match.end()
    if pos < len(text):
        yield text[pos:], False


# ---------------------------------------------------------------- HF tokenizer.json (byte-level BPE)


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


def _byte_level_to_bytes(token: str) -> bytes | None:
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

    backend = "python BPE"

    def __init__(self, path: Path, core: bool | None = None):
        """`core`: encode with tiktoken's core where it is exact (None: check whether it is; True: checked before,
        as when unpickled in a worker; False: never)."""
        spec = _read_json(path)
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ConfigError(f"tokenizer file '{path}': model type is {model.get('type')!r}, expected a BPE model")
        self.source = path
        self._load_text_pipeline(path, spec)
        self._load_model(path, model)
        self._load_added_tokens(path, spec.get("added_tokens") or [])
        self._load_special_ids(path, spec.get("post_processor"))
        self._cache: dict[bytes, list[int]] = {}
        self._core: tiktoken.Encoding | None = None
        if core is not False:
            self._start_core(path, spec, checked=bool(core))

    @property
    def releases_gil(self) -> bool:
        return self._core is not None  # the Python BPE holds the GIL throughout

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its text functions (workers started by spawn or forkserver build them again from the
        file's specs) and without its word cache."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_steps", "_normalize", "_cache")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _cache={})
        self._normalize = _normalizer(self.source, self._specs["normalizer"])

    # -- loading

    def _load_text_pipeline(self, path: Path, spec: dict[str, Any]) -> None:
        self._specs = {name: spec.get(name) for name in ("normalizer", "pre_tokenizer")}
        self._steps = _pre_tokenizer_steps(path, spec.get("pre_tokenizer"))
        self._normalize = _normalizer(path, spec.get("normalizer"))

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

    def _load_model(self, path: Path, model: dict[str, Any]) -> None:
        vocab = _bpe_vocab(path, model)
        self._token_ids: dict[str, int] = dict(vocab)
        self._vocab = {raw: i for tok, i in vocab.items() if (raw := _byte_level_to_bytes(tok)) is not None}
        self._id_to_bytes = {i: raw for raw, i in self._vocab.items()}
        self._merge_ranks = _merge_ranks(path, model.get("merges") or [], self._vocab)
        self._ignore_merges, self._unk_id = _merge_options(model, vocab)

    def _load_added_tokens(self, path: Path, added: list[dict[str, Any]]) -> None:
        for tok in added:
            content, tid = tok.get("content"), tok.get("id")
            if not isinstance(content, str) or not content or not isinstance(tid, int):
                raise ConfigError(f"tokenizer file '{path}': each added token needs a non-empty content and an id")
            self._token_ids[content] = tid
            self._id_to_bytes[tid] = content.encode("utf-8")
        # longest first: HF matches added tokens leftmost-longest
        by_length = sorted(added, key=lambda t: len(t["content"]), reverse=True)
        self._added_all = _AddedTokenMatcher.build(by_length)
        self._added_plain = _AddedTokenMatcher.build([t for t in by_length if not t.get("special", False)])
        self.special_ids = frozenset(t["id"] for t in added if t.get("special", False))
        self._added_ids = frozenset(t["id"] for t in added)
        self.vocab_size = max(self._token_ids.values(), default=-1) + 1

    def _load_special_ids(self, path: Path, post_processor: dict[str, Any] | None) -> None:
        config = _hf_tokenizer_config(path.parent)
        template_prefix, template_suffix = _template_specials(post_processor)
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
            ids.extend([added_id] if added_id is not None else self._encode_segment(piece))
        return ids

    def _encode_segment(self, text: str) -> list[int]:
        if self._core is not None:
            text = self._normalize(text)
            if self._prefix_space and not text.startswith(" "):
                text = " " + text
            return self._core.encode_ordinary(text)
        pieces = [self._normalize(text)]
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"tokenizer file '{path}' is not a readable JSON file ({err})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"tokenizer file '{path}': expected a JSON object")
    return spec


def _hf_tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json over special_tokens_map.json, both optional."""
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            config.update(_read_json(folder / name))
    return config


def _bpe_vocab(path: Path, model: dict[str, Any]) -> dict[str, int]:
    """A tokenizer.json BPE model's vocabulary, checked: token strings to integer ids, no options we do not apply."""
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ConfigError(f"tokenizer file '{path}': BPE option '{key}' is not supported")
    vocab = model.get("vocab") or {}
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ConfigError(f"tokenizer file '{path}': model.vocab must map token strings to integer ids")
    return vocab


def _merge_options(model: dict[str, Any], vocab: dict[str, int]) -> tuple[bool, int | None]:
    """(ignore_merges, the unknown token's id or None) of a BPE model."""
    unk = model.get("unk_token")
    return bool(model.get("ignore_merges", False)), vocab.get(unk) if unk else None


def _merge_ranks(path: Path, merges: list[Any], vocab: dict[bytes, int]) -> dict[tuple[bytes, bytes], int]:
    ranks: dict[tuple[bytes, bytes], int] = {}
    for rank, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        raw = [_byte_level_to_bytes(side) if isinstance(side, str) else None for side in pair]
        if len(raw) != 2 or None in raw or raw[0] not in vocab or raw[1] not in vocab or raw[0] + raw[1] not in vocab:
            raise ConfigError(f"tokenizer file '{path}': merge #{rank} {merge!r} is not a pair of byte-level vocab "
                              f"tokens whose join is in the vocab")
        ranks.setdefault((raw[0], raw[1]), rank)
    return ranks


class _AddedTokenMatcher:
    """Finds added tokens in text; each token is one capturing group so a match names its id."""

    def __init__(self, regex: re.Pattern[str], ids: list[int]):
        self._regex, self._ids = regex, ids

    @classmethod
    def build(cls, tokens: list[dict[str, Any]]) -> _AddedTokenMatcher | None:
        if not tokens:
            return None
        regex = re.compile("|".join(f"({_added_token_pattern(tok)})" for tok in tokens))
        return cls(regex, [tok["id"] for tok in tokens])

    def split(self, text: str) -> Iterator[tuple[str, int | None]]:
        """(text, None) for plain stretches and (token text, id) for added tokens, in order."""
        pos = 0
        for match in self._regex.finditer(text):
            if match.start() > pos:
                yield text[pos:match.start()], None
            yield match.group(), self._ids[match.lastindex - 1]
            pos = match.end()
        if pos < len(text):
            yield text[pos:], None


def _added_token_pattern(token: dict[str, Any]) -> str:
    pattern = re.escape(token["content"])
    if token.get("single_word"):
        pattern = rf"(?<!\w){pattern}(?!\w)"
    if token.get("lstrip"):
        pattern = rf"\s*{pattern}"
    if token.get("rstrip"):
        pattern = rf"{pattern}\s*"
    return pattern


def _template_specials(post_processor: dict[str, Any] | None) -> tuple[int, int]:
    """Ids of the single special token before / after $A in a TemplateProcessing (-1 when absent)."""
    if not post_processor:
        return -1, -1
    if post_processor.get("type") == "Sequence":
        for sub in post_processor.get("processors") or []:
            found = _template_specials(sub)
            if found != (-1, -1):
                return found
        return -1, -1
    if post_processor.get("type") != "TemplateProcessing":
        return -1, -1
    items = post_processor.get("single") or []
    names = ["$A" if "Sequence" in item else item.get("SpecialToken", {}).get("id") for item in items]
    if "$A" not in names:
        return -1, -1
    at = names.index("$A")
    specials = post_processor.get("special_tokens") or {}

    def single_id(side: list[str]) -> int:
        ids = specials.get(side[0], {}).get("ids") if len(side) == 1 else None
        return ids[0] if ids and len(ids) == 1 else -1

    return single_id(names[:at]), single_id(names[at + 1:])


def _normalizer(path: Path, spec: dict[str, Any] | None) -> Callable[[str], str]:
    if not spec:
        return lambda text: text
    kind = spec.get("type")
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return functools.partial(unicodedata.normalize, kind)
    if kind == "Sequence":
        parts = [_normalizer(path, sub) for sub in spec.get("normalizers") or []]
        return lambda text: functools.reduce(lambda acc, fn: fn(acc), parts, text)
    if kind == "Prepend":  # on every non-empty piece between added tokens (Llama 2 / Mistral v0.1 files)
        prefix = str(spec.get("prepend", ""))
        return lambda text: prefix + text if text else text
    if kind == "Replace":
        return _replace(path, spec)
    raise ConfigError(f"tokenizer file '{path}': normalizer {kind!r} is not supported (none, NFC/NFD/NFKC/NFKD, "
                      "Prepend, Replace or a Sequence of them)")


def _replace(path: Path, spec: dict[str, Any]) -> Callable[[str], str]:
    """A Replace normalizer: every match of its String or Regex pattern becomes its content."""
    pattern, content = spec.get("pattern") or {}, str(spec.get("content", ""))
    if "String" in pattern:
        return lambda text: text.replace(pattern["String"], content)
    if "Regex" in pattern:
        try:
            regex = compile_pattern(pattern["Regex"])
        except (ValueError, re.error) as err:
            raise ConfigError(f"tokenizer file '{path}': cannot use the Replace pattern ({err})") from None
        return lambda text: regex.sub(lambda _: content, text)
    raise ConfigError(f"tokenizer file '{path}': Replace normalizer without a String or Regex pattern")


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
            return lambda piece: [p for p, _ in _split_on(regex, piece)]
    except (ValueError, re.error) as err:
        raise ConfigError(f"tokenizer file '{path}': cannot use the {kind} pre-tokenizer pattern ({err})") from None
    raise ConfigError(f"tokenizer file '{path}': pre-tokenizer {kind!r} is not supported (ByteLevel, Split, Digits)")


def _byte_level_step(add_prefix_space: bool, use_regex: bool) -> PreTokenizeStep:
    regex = compile_pattern(GPT2_PATTERN) if use_regex else None

    def step(piece: str) -> list[str]:
        if add_prefix_space and not piece.startswith(" "):
            piece = " " + piece
        return [p for p, _ in _split_on(regex, piece)] if regex is not None else [piece]

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
    return lambda piece: [p for p, matched in _split_on(regex, piece) if keep_matches or not matched]


# ---------------------------------------------------------------- HF tokenizer.json (BPE with byte fallback)


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
        self._normalize = _normalizer(path, spec.get("normalizer"))
        pre = spec.get("pre_tokenizer")
        self._metaspace, self._prepend_scheme, self._split = None, "never", False
        if pre:
            if pre.get("type") != "Metaspace":
                raise ConfigError(f"tokenizer file '{path}': pre-tokenizer {pre.get('type')!r} is not supported with "
                                  "byte_fallback (none or Metaspace)")
            self._metaspace = str(pre.get("replacement", "▁"))
            scheme = pre.get("prepend_scheme") or ("always" if pre.get("add_prefix_space", True) else "never")
            if scheme not in ("first", "always", "never"):
                raise ConfigError(f"tokenizer file '{path}': Metaspace prepend_scheme {scheme!r} is not supported")
            self._prepend_scheme, self._split = scheme, bool(pre.get("split", True))
        normalizers = _flat_normalizers(spec.get("normalizer"))
        self._strips_leading_space = self._prepend_scheme != "never" or any(
            n.get("type") == "Prepend" for n in normalizers)

    def _load_model(self, path: Path, model: dict[str, Any]) -> None:
        vocab = _bpe_vocab(path, model)
        self._token_ids = dict(vocab)
        self._piece_ids = dict(vocab)
        self._byte_ids = {int(m.group(1), 16): i for tok, i in vocab.items() if (m := BYTE_TOKEN.fullmatch(tok))}
        self._id_to_bytes = {i: self._piece_bytes(tok) for tok, i in vocab.items()}
        self._merges = _char_merges(path, model.get("merges") or [], vocab)
        self._ignore_merges, self._unk_id = _merge_options(model, vocab)
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


# ---------------------------------------------------------------- entry point


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
    spec = _read_json(path)
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
    processor = _load_sentencepiece(data)
    if processor is not None:
        return SentencePieceTokenizer(processor, path)
    raise ConfigError(f"tokenizer file '{path}' is neither a tiktoken file ('<base64> <rank>' lines) "
                      f"nor a sentencepiece model")


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
