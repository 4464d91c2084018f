"""The global order of a countable dataset: which stored sample (a window, an example, a pair) each position of an
epoch holds, the stored order or a seeded permutation per epoch (training.shuffle). It is computed, not stored: any
rank, any worker and any resumed run asks for any position and gets the same answer, in O(1) memory (a Feistel
network over the positions, cycle-walked into [0, size)); and the epochs of the stream a countable source hands
out (Epochs: which epoch and position a global sample index is, its saved form and the check of a saved one)."""

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

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


class Epochs:
    """Sample i of a countable source's stream over every epoch, as (epoch, position in it): the one place that
    counts epochs, saves a position and checks a saved one. Epochs may differ in size (whole records packed into
    windows in another order each epoch): their first indices are found by walking, and a saved position names its
    epoch's start. A position saved under another order (another epoch size, training.shuffle or seed) is refused
    in one line, since continuing it would read other samples than the saved run would have."""

    def __init__(self, name: str, epoch_size: Callable[[int], int], seed: int, shuffle: bool,
                 fixed_size: bool = False):
        self.name = name
        self.epoch_size = epoch_size
        self.seed, self.shuffle = seed, shuffle
        self.fixed_size = fixed_size  # every epoch is epoch 0's size: located by division
        self._starts = {0: 0}  # known first indices of epochs

    def order(self, size: int) -> GlobalOrder:
        """The stored item at each position of an epoch of `size` items, in this order's seed and shuffle."""
        return GlobalOrder(size, self.seed, self.shuffle)

    def locate(self, index: int) -> tuple[int, int, int]:
        """(epoch, position in it, index where it starts) of sample `index`."""
        if self.fixed_size:
            epoch, position = divmod(index, max(self.epoch_size(0), 1))
            return epoch, position, index - position
        known = sorted(self._starts.items())
        epoch, start = known[bisect.bisect_right([s for _, s in known], index) - 1]
        while index >= start + self.epoch_size(epoch):
            start += self.epoch_size(epoch)
            epoch += 1
            self._starts[epoch] = start
        return epoch, index - start, start

    def describe(self) -> dict[str, Any]:
        """What a saved position depends on: a resume with other values is refused."""
        return {"samples_in_epoch_0": self.epoch_size(0), "shuffle": self.shuffle,
                "seed": self.seed if self.shuffle else None}

    def state_at(self, index: int) -> dict[str, Any]:
        """The saved form of the position before sample `index`."""
        epoch, _, start = self.locate(index)
        return {"next": index, "epoch": epoch, "epoch_start": start, "order": self.describe()}

    def seek(self, state: dict[str, Any] | None) -> int:
        """The next index of a state this order handed out (0 for None), its epoch start remembered."""
        if state is None:
            return 0
        if "next" not in state:
            raise ConfigError(f"the checkpoint's data position of dataset '{self.name}' was read in order as a "
                              "stream; this run reads it by index (token files, or shuffled records): start a new run "
                              "(job.dump_folder), or read the data as that run did")
        if state.get("order") != self.describe():
            raise ConfigError(f"the checkpoint's data position of dataset '{self.name}' is for another order "
                              f"({state.get('order')}), this run's is {self.describe()}: the data, training.shuffle "
                              "or the seed changed")
        self._starts[state["epoch"]] = state["epoch_start"]
        return state["next"]
