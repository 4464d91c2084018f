"""What both tokenizer.json BPE back ends read from the file: the JSON, the model's vocabulary and options, the added
tokens and their matcher, the special ids of tokenizer_config.json and the post-processor, the normalizer."""

from __future__ import annotations

import functools
import itertools
import json
import re
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from titan_lite.data.tokenizer.regex import compile_pattern
from titan_lite.errors import ConfigError


def read_json(path: Path) -> dict[str, Any]:
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"tokenizer file '{path}' is not a readable JSON file ({err})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"tokenizer file '{path}': expected a JSON object")
    return spec


def hf_tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json over special_tokens_map.json, both optional."""
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            config.update(read_json(folder / name))
    return config


def bpe_vocab(path: Path, model: dict[str, Any]) -> dict[str, int]:
    """A tokenizer.json BPE model's vocabulary, checked: token strings to integer ids, no options we do not apply."""
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ConfigError(f"tokenizer file '{path}': BPE option '{key}' is not supported")
    vocab = model.get("vocab") or {}
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ConfigError(f"tokenizer file '{path}': model.vocab must map token strings to integer ids")
    return vocab


def merge_options(model: dict[str, Any], vocab: dict[str, int]) -> tuple[bool, int | None]:
    """(ignore_merges, the unknown token's id or None) of a BPE model."""
    unk = model.get("unk_token")
    return bool(model.get("ignore_merges", False)), vocab.get(unk) if unk else None



class AddedTokenMatcher:
    """Finds added tokens in text, leftmost and then longest first, as HF does. Each run of consecutive tokens
    (longest first) that match as plain text is one capturing group holding their trie (Python's `re` tries a
    trie's branches by one character, a plain alternation of hundreds of reserved tokens each in turn); each token
    that strips spaces or matches only as a word is a group of its own."""

    def __init__(self, regex: re.Pattern[str], groups: list[int | dict[str, int]]):
        self._regex, self._groups = regex, groups

    @classmethod
    def build(cls, tokens: list[dict[str, Any]]) -> AddedTokenMatcher | None:
        """`tokens` in the order they are tried: longest first."""
        if not tokens:
            return None
        patterns: list[str] = []
        groups: list[int | dict[str, int]] = []
        for plain, run in itertools.groupby(tokens, key=_matches_as_text):
            run = list(run)
            if plain:
                ids: dict[str, int] = {}
                for tok in run:
                    ids.setdefault(tok["content"], tok["id"])  # the first of equal contents wins, as in order
                patterns.append(_trie_pattern(list(ids)))
                groups.append(ids)
            else:
                patterns += [_added_token_pattern(tok) for tok in run]
                groups += [tok["id"] for tok in run]
        return cls(re.compile("|".join(f"({p})" for p in patterns)), groups)

    def split(self, text: str) -> Iterator[tuple[str, int | None]]:
        """(text, None) for plain stretches and (token text, id) for added tokens, in order."""
        pos = 0
        for match in self._regex.finditer(text):
            if match.start() > pos:
                yield text[pos:match.start()], None
            found = self._groups[match.lastindex - 1]
            yield match.group(), found if isinstance(found, int) else found[match.group()]
            pos = match.end()
        if pos < len(text):
            yield text[pos:], None


def _matches_as_text(token: dict[str, Any]) -> bool:
    return not (token.get("single_word") or token.get("lstrip") or token.get("rstrip"))


def _trie_pattern(words: list[str]) -> str:
    """A regex matching the longest of `words` that starts where it is tried (no capturing groups)."""
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return _trie_node(trie)


def _trie_node(node: dict[str, dict]) -> str:
    branches = [re.escape(ch) + _trie_node(child) for ch, child in sorted(node.items()) if ch]
    if not branches:
        return ""
    ends_here = "" in node
    body = branches[0] if len(branches) == 1 and not ends_here else "(?:" + "|".join(branches) + ")"
    return body + "?" if ends_here else body  # greedy: the longer word first, this one if none goes on


def _added_token_pattern(token: dict[str, Any]) -> str:
    pattern = re.escape(token["content"])
    if token.get("single_word"):
        pattern = rf"(?<!\w){pattern}(?!\w)"
    if token.get("lstrip"):
        pattern = rf"\s*{pattern}"
    if token.get("rstrip"):
        pattern = rf"{pattern}\s*"
    return pattern


def template_specials(post_processor: dict[str, Any] | None) -> tuple[int, int]:
    """Ids of the single special token before / after $A in a TemplateProcessing (-1 when absent)."""
    if not post_processor:
        return -1, -1
    if post_processor.get("type") == "Sequence":
        for sub in post_processor.get("processors") or []:
            found = template_specials(sub)
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


def build_normalizer(path: Path, spec: dict[str, Any] | None) -> Callable[[str], str]:
    if not spec:
        return lambda text: text
    kind = spec.get("type")
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return functools.partial(unicodedata.normalize, kind)
    if kind == "Sequence":
        parts = [build_normalizer(path, sub) for sub in spec.get("normalizers") or []]
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


