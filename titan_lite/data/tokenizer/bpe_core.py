"""Byte-level BPE on tiktoken's core: a tokenizer.json's mergeable ranks taken from its vocabulary, the checks that make
tiktoken's ids exactly those of the merge list, and its pre-tokenizer sequence written as one split pattern."""

import heapq
from typing import Any

import tiktoken

# The pattern a HF ByteLevel pre-tokenizer uses when use_regex is true (GPT-2's).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def merge_symbols(symbols: list[int], merges: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """BPE over a sequence of ids in O(n log n): repeatedly merge the adjacent pair of lowest rank (leftmost on ties),
    as `tokenizers` does, with a heap of candidate pairs and a linked list of the surviving symbols."""
    ids = list(symbols)
    nxt = list(range(1, len(ids) + 1))
    prev = list(range(-1, len(ids) - 1))
    alive = [True] * len(ids)
    heap = [(merges[(ids[i], ids[i + 1])][0], i, ids[i], ids[i + 1]) for i in range(len(ids) - 1)
            if (ids[i], ids[i + 1]) in merges]
    heapq.heapify(heap)
    while heap:
        rank, i, left, right = heapq.heappop(heap)
        j = nxt[i] if alive[i] else len(ids)
        if j >= len(ids) or ids[i] != left or ids[j] != right:
            continue  # a stale candidate: one side merged since
        ids[i] = merges[(left, right)][1]
        alive[j] = False
        nxt[i] = nxt[j]
        if nxt[j] < len(ids):
            prev[nxt[j]] = i
        for a, b in ((prev[i], i), (i, nxt[i])):
            if a >= 0 and b < len(ids) and (ids[a], ids[b]) in merges:
                heapq.heappush(heap, (merges[(ids[a], ids[b])][0], a, ids[a], ids[b]))
    return [tid for tid, keep in zip(ids, alive, strict=True) if keep]


# ---------------------------------------------------------------- the split pattern


def _digits_pattern(individual: bool) -> str:
    """GPT-2's pattern run on the pieces between numbers, the numbers split out first (a Digits pre-tokenizer, whose
    'digit' is any Unicode number): a number is its own alternative, no other alternative takes one, and the lookahead
    of trailing whitespace treats a number like the end of a piece."""
    number = r"\p{N}" if individual else r"\p{N}+"
    return (rf"'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+|{number}| ?[^\s\p{{L}}\p{{N}}]+|\s+(?![^\s\p{{N}}])|\s+")


def split_pattern(steps: list[dict[str, Any]]) -> tuple[str | None, bool, str]:
    """(one tiktoken split pattern doing what the pre-tokenizer steps do, whether a space is put before each text
    first, '') or (None, False, why not). `steps` end with ByteLevel."""
    *before, byte_level = steps
    prefix, use_regex = bool(byte_level.get("add_prefix_space", True)), bool(byte_level.get("use_regex", True))
    kinds = [step.get("type") for step in before]
    if not before:
        if not use_regex:
            return None, False, "ByteLevel without its regex leaves each text one piece"
        return GPT2_PATTERN, prefix, ""
    if prefix:
        return None, False, "add_prefix_space after another pre-tokenizer puts a space before every piece"
    if kinds == ["Digits"] and use_regex:
        return _digits_pattern(bool(before[0].get("individual_digits"))), False, ""
    if kinds == ["Split"] and not use_regex:
        split = before[0]
        regex = (split.get("pattern") or {}).get("Regex")
        behavior = str(split.get("behavior", "Isolated")).lower()
        if regex is not None and behavior == "isolated" and not split.get("invert"):
            return regex, False, ""
    return None, False, f"the pre-tokenizer sequence {' + '.join([*kinds, 'ByteLevel'])} is not one split pattern"


# ---------------------------------------------------------------- the ranks


def exact_ranks(vocab: dict[bytes, int], merges: dict[tuple[bytes, bytes], int]) -> tuple[dict[bytes, int] | None, str]:
    """(tiktoken's mergeable ranks, '') when its BPE gives exactly the merge list's ids on every text that holds
    only bytes the vocabulary has as tokens (missing_bytes), else (None, why not).

    tiktoken merges the adjacent pair whose join has the lowest rank, `tokenizers` the pair listed first. With the ids
    as ranks the two agree when the ids grow in merge order (a token's several merges, as converted tiktoken
    vocabularies have, next to each other) and every token is what the merge list makes of its own bytes: then a join
    tiktoken may make is one the list makes too, and at the same turn."""
    last, last_pair = -1, None
    for (left, right), rank in merges.items():  # in merge order
        made = vocab[left + right]
        if made < last:
            shown = " ".join(p.decode("utf-8", "replace") for p in (left, right))
            before = " ".join(p.decode("utf-8", "replace") for p in last_pair)
            return None, (f"merge #{rank} '{shown}' makes id {made}, below id {last} of the earlier merge "
                          f"'{before}' (merge order is not id order)")
        last, last_pair = made, (left, right)
    singles = [vocab.get(bytes([b])) for b in range(256)]
    missing = frozenset(missing_bytes(vocab))
    by_ids = {(vocab[a], vocab[b]): (rank, vocab[a + b]) for (a, b), rank in merges.items()}
    for token, tid in vocab.items():
        if missing and not missing.isdisjoint(token):
            continue  # never reached by the core: a text holding one of its bytes is encoded in Python
        if len(token) > 1 and _short_bpe([singles[b] for b in token], by_ids) != [tid]:
            return None, (f"token {tid} {token.decode('utf-8', 'replace')!r} is not what the merges make of its "
                          "bytes")
    return dict(vocab), ""


def missing_bytes(vocab: dict[bytes, int]) -> list[int]:
    """The byte values that are not a token of their own: tiktoken's core cannot start a text holding one (SmolLM2's
    vocabulary lacks 21, most of which never occur in UTF-8)."""
    return [b for b in range(256) if bytes([b]) not in vocab]


def _short_bpe(ids: list[int], merges: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """merge_symbols for a few symbols (a vocabulary token's bytes): a plain scan is quicker than a heap there."""
    none = (1 << 62, 0)
    while len(ids) > 1:
        best, at = none, -1
        for i in range(len(ids) - 1):
            found = merges.get((ids[i], ids[i + 1]), none)
            if found[0] < best[0]:
                best, at = found, i
        if at < 0:
            break
        ids[at:at + 2] = [best[1]]
    return ids


def tiktoken_encoding(name: str, pattern: str, ranks: dict[bytes, int]) -> tiktoken.Encoding:
    """The encoding of plain text (added tokens are split out before it)."""
    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
