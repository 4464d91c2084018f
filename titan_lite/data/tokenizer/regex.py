"""Tiktoken/Oniguruma split patterns run by Python's `re` (\\p{..} classes, Unicode's \\s), and the splitting helpers
built on them."""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterator

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


def alternation_regex(literals: list[str]) -> re.Pattern[str] | None:
    """Matches any of `literals`, longest first (like the leftmost-longest matching of HF added tokens)."""
    if not literals:
        return None
    return re.compile("|".join(re.escape(lit) for lit in sorted(literals, key=len, reverse=True)))


def split_on(regex: re.Pattern[str], text: str) -> Iterator[tuple[str, bool]]:
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

