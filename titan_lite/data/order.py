"""The global order of a countable dataset: which stored sample (a window, an example, a pair) each position of an
epoch holds, the stored order or a seeded permutation per epoch (training.shuffle). It is computed, not stored: any
rank, any worker and any resumed run asks for any position and gets the same answer, in O(1) memory (a Feistel
network over the positions, cycle-walked into [0, size))."""

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from titan_lite.errors import ConfigError

_MASK = (1 << 64) - 1
_ROUNDS = 4


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of x."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """_mix on an array of uint64 (numpy's uint64 arithmetic wraps as & _MASK does)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Permutation:
    """A seeded bijection of [0, size): a balanced Feistel network over the smallest even power of two that holds
    size, applied again while the result falls outside (cycle walking), so it stays a bijection of [0, size)."""

    size: int
    seed: int
    epoch: int

    @property
    def half_bits(self) -> int:
        return max(1, ((max(self.size, 2) - 1).bit_length() + 1) // 2)

    @cached_property
    def _keys(self) -> list[int]:
        base = _mix((self.seed & _MASK) ^ _mix(self.epoch & _MASK))
        return [_mix(base ^ (r + 1) * 0x9E3779B97F4A7C15 & _MASK) for r in range(_ROUNDS)]

    def _round_trip(self, x: int) -> int:
        h = self.half_bits
        mask = (1 << h) - 1
        left, right = x >> h, x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << h) | right

    def __call__(self, position: int) -> int:
        x = self._round_trip(position)
        while x >= self.size:
            x = self._round_trip(x)
        return x

    def _round_trip_array(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half_bits)
        mask = np.uint64((1 << self.half_bits) - 1)
        left, right = x >> h, x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix_array(right ^ np.uint64(key)) & mask)
        return (left << h) | right

    def all(self) -> np.ndarray:
        """The whole permutation: element j is self(j)."""
        x = self._round_trip_array(np.arange(self.size, dtype=np.uint64))
        outside = x >= self.size
        while outside.any():
            x[outside] = self._round_trip_array(x[outside])
            outside = x >= self.size
        return x.astype(np.int64)


@lru_cache(maxsize=4)
def _permutation(size: int, seed: int, epoch: int) -> Permutation:
    """The epoch's permutation, its round keys computed once (a sample's lookup is then a few hashes)."""
    return Permutation(size, seed, epoch)


@dataclass(frozen=True)
class GlobalOrder:
    """Position j of epoch e holds stored sample j, or Permutation(size, seed, e)(j) when shuffled."""

    size: int
    seed: int = 0
    shuffle: bool = False

    def stored(self, epoch: int, position: int) -> int:
        return _permutation(self.size, self.seed, epoch)(position) if self.shuffle else position

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The stored sample of every position of the epoch."""
        if not self.shuffle:
            return np.arange(self.size, dtype=np.int64)
        return Permutation(self.size, self.seed, epoch).all()


def data_order(cfg, section: str, countable: bool, where: str) -> tuple[int, bool]:
    """(seed, shuffle) of [training] or [validation]'s data. Validation reads in stored order. training.shuffle is on
    by default for data that can be counted (token files, instruction and preference rows) and off for raw text,
    which streams in order: asking to shuffle that is refused (tokenize it once instead). The seed is debug.seed's."""
    seed = cfg.debug.seed if cfg.debug.seed is not None else 0
    if section != "training":
        return seed, False
    asked = cfg.training.shuffle
    if asked and not countable:
        raise ConfigError(f"'training.shuffle' = true, but {where} is raw text, read in order as a stream; tokenize it "
                          "once with scripts/tokenize_data.py and point the path at the token folder to shuffle it")
    return seed, countable if asked is None else asked
