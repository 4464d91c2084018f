"""Trains a small byte-level BPE (Llama 3 pre-tokenizer) in pure Python and writes a Llama 3 tiktoken tokenizer.model.

Usage:
  .venv/bin/python scripts/train_bpe_tokenizer.py --input a.txt b.txt --vocab_size 1792 \
      --output assets/tokenizer/tokenizer.model

--vocab_size counts the base tokens (256 bytes + merges); the Llama 3 loader appends 256 special tokens after them.
"""

from __future__ import annotations

import base64
import sys
import time
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.data.tokenizer import LLAMA3_PATTERN, compile_pattern
from titan_lite.job.cli import ScriptParser

Pair = tuple[int, int]


def count_pretokens(paths: list[Path]) -> Counter[bytes]:
    """How often each pre-token (a Llama 3 regex piece, as UTF-8 bytes) occurs in the files."""
    regex = compile_pattern(LLAMA3_PATTERN)
    counts: Counter[bytes] = Counter()
    for path in paths:
        counts.update(piece.encode("utf-8") for piece in regex.findall(path.read_text(encoding="utf-8")))
    return counts


class _PairStats:
    """Weighted counts of adjacent token pairs over the corpus words, and which words hold each pair."""

    def __init__(self, words: list[list[int]], freqs: list[int]):
        self.words, self.freqs = words, freqs
        self.counts: Counter[Pair] = Counter()
        self.holders: defaultdict[Pair, set[int]] = defaultdict(set)
        for index in range(len(words)):
            self._add_word(index, +1)

    def _add_word(self, index: int, sign: int) -> None:
        word, freq = self.words[index], self.freqs[index]
        for pair in pairwise(word):
            self.counts[pair] += sign * freq
            if sign > 0:
                self.holders[pair].add(index)
            elif self.counts[pair] <= 0:
                del self.counts[pair]

    def most_frequent(self) -> Pair:
        # ties go to the pair of lowest ids, so the result does not depend on dict order
        return max(self.counts, key=lambda pair: (self.counts[pair], -pair[0], -pair[1]))

    def merge(self, pair: Pair, new_id: int) -> None:
        """Replace every occurrence of `pair` (left to right) by `new_id`, updating the counts."""
        for index in self.holders.pop(pair, ()):
            word = self.words[index]
            if not any(a == pair[0] and b == pair[1] for a, b in pairwise(word)):
                continue  # stale holder: an earlier merge already consumed the pair here
            self._add_word(index, -1)
            self.words[index] = _merge_word(word, pair, new_id)
            self._add_word(index, +1)
        self.counts.pop(pair, None)


def _merge_word(word: list[int], pair: Pair, new_id: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(counts: Counter[bytes], vocab_size: int) -> list[bytes]:
    """Token byte strings in rank order: the 256 single bytes, then one per merge until `vocab_size`."""
    if vocab_size < 256:
        raise ValueError(f"--vocab_size must be at least 256 (the single bytes), got {vocab_size}")
    tokens = [bytes([b]) for b in range(256)]
    token_ids = {tok: i for i, tok in enumerate(tokens)}
    stats = _PairStats([list(word) for word in counts], list(counts.values()))
    while len(tokens) < vocab_size and stats.counts:
        pair = stats.most_frequent()
        joined = tokens[pair[0]] + tokens[pair[1]]
        new_id = token_ids.get(joined)  # a different split of an existing token reuses its id
        if new_id is None:
            new_id = token_ids[joined] = len(tokens)
            tokens.append(joined)
        stats.merge(pair, new_id)
    return tokens


def write_tiktoken_model(tokens: list[bytes], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(tokens))
    output.write_text("".join(lines), encoding="ascii")


def main(argv: list[str] | None = None) -> None:
    parser = ScriptParser(__doc__)
    parser.add_argument("--input", nargs="+", type=Path, required=True, help="UTF-8 text files to train on")
    parser.add_argument("--vocab_size", type=int, required=True, help="base tokens, 256 bytes included")
    parser.add_argument("--output", type=Path, required=True, help="where to write tokenizer.model")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    counts = count_pretokens(args.input)
    tokens = train_bpe(counts, args.vocab_size)
    write_tiktoken_model(tokens, args.output)
    print(f"wrote {len(tokens)} base tokens from {len(counts)} distinct pre-tokens to {args.output} "
          f"in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
