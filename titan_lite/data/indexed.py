"""Sources that hand out sample i of their global order directly, so that a rank, and each of its DataLoader workers,
reads only its own samples: pre-training windows over a token table (token files), and records (instruction examples,
preference pairs; from token files or tokenized at the start of the run) one per sample, packed whole into windows, or
packed end to end. The order within an epoch is the stored one or a seeded permutation (data/order.py). Workers split
the reading only: a token-file window is one memory-mapped read, which the main process alone does fast enough."""

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from titan_lite.data.datasets import Deferred, Sample, packed_sample
from titan_lite.data.order import Epochs
from titan_lite.data.token_files import TokenTable, check_kind, check_tokenizer, open_token_folder
from titan_lite.errors import ConfigError

logger = logging.getLogger(__name__)


class IndexedSource:
    """A SampleSource whose sample i (of the stream over every epoch) is computed directly. Its epochs (which epoch
    and position sample i is, the saved position and its check) are data/order.py's Epochs. Subclasses give
    epoch_size(epoch) and read(epoch, position)."""

    name: str
    infinite: bool
    fixed_epochs = False  # every epoch has epoch 0's size

    def __init__(self, name: str, infinite: bool, seed: int, shuffle: bool):
        self.name = name
        self.infinite = infinite
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = Epochs(name, self.epoch_size, seed, shuffle, self.fixed_epochs)

    # -- what subclasses give

    def epoch_size(self, epoch: int) -> int:
        raise NotImplementedError

    def read(self, epoch: int, position: int) -> Sample:
        raise NotImplementedError

    def prepare(self) -> None:
        """Do the work every reader shares (tokenizing rows up front) before workers are started."""

    # -- the global order

    def total(self) -> int | None:
        """Samples of a finite source (one epoch), None for an infinite one."""
        return None if self.infinite else self.epoch_size(0)

    def sample(self, index: int) -> Sample:
        epoch, position, _ = self.epochs.locate(index)
        if not self.infinite and epoch > 0:
            raise IndexError(f"sample {index} of a finite source of {self.epoch_size(0)}")
        return self.read(epoch, position)

    def state_at(self, index: int) -> dict[str, Any]:
        return self.epochs.state_at(index)

    def seek(self, state: dict[str, Any] | None) -> int:
        """The next index of a state this source handed out (0 for None); one of another order is refused."""
        return self.epochs.seek(state)

    def samples(self, state: dict[str, Any] | None = None) -> Iterator[tuple[Sample, dict[str, Any]]]:
        """The samples in order from a state on (a stream, as other sources give them)."""
        index = self.seek(state)
        total = self.total()
        while total is None or index < total:
            sample = self.sample(index)
            index += 1
            yield sample, self.state_at(index)

    def refs(self, state: dict[str, Any] | None = None) -> Iterator[tuple[Deferred, dict[str, Any]]]:
        """The samples in order from a state on, each read only when loaded (see Deferred)."""
        index = self.seek(state)
        total = self.total()
        while total is None or index < total:
            index += 1
            yield Deferred(self, index - 1), self.state_at(index)

    def _log_epoch(self, epoch: int, position: int) -> None:
        if position == 0 and epoch > 0:
            logger.info("Dataset %s: starting epoch %d", self.name, epoch)


# ---------------------------------------------------------------- token streams


def document_runs(keys: np.ndarray) -> np.ndarray:
    """Each token's document id within a window: 0 for the first document (or piece of one), then +1 at each change
    of key (as packing numbers the documents of a window)."""
    runs = np.zeros(len(keys), dtype=np.int64)
    if len(keys) > 1:
        runs[1:] = np.cumsum(keys[1:] != keys[:-1])
    return runs


class TableStream:
    """A token table's documents end to end, in stored order: spans of it with masks and document keys."""

    def __init__(self, table: TokenTable):
        self.table = table
        self.total = table.num_tokens

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        offsets = self.table.offsets
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
        keys = np.full(stop - start, first, dtype=np.int64)
        for doc in range(first + 1, last + 1):
            keys[int(offsets[doc]) - start:] = doc
        return self.table.tokens(start, stop), self.table.mask(start, stop), keys


class ItemStream:
    """Documents of a token table in a given order, end to end (records packed across windows)."""

    def __init__(self, table: TokenTable, documents: np.ndarray):
        self.table = table
        self.documents = documents
        self.bounds = np.concatenate([[0], np.cumsum(table.lengths()[documents])]).astype(np.int64)
        self.total = int(self.bounds[-1])

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        first = int(np.searchsorted(self.bounds, start, side="right")) - 1
        tokens, masks, keys = [], [], []
        k = first
        while start < stop:
            base = int(self.table.offsets[self.documents[k]]) - int(self.bounds[k])
            end = min(stop, int(self.bounds[k + 1]))
            if end > start:
                tokens.append(self.table.tokens(base + start, base + end))
                masks.append(self.table.mask(base + start, base + end))
                keys.append(np.full(end - start, k, dtype=np.int64))
            start, k = end, k + 1
        return np.concatenate(tokens), np.concatenate(masks), np.concatenate(keys)


def read_wrapped(stream, start: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`length` tokens from position `start` of the stream repeated end to end (a window may run over the end into
    the next pass, as a stream of documents read epoch after epoch does); keys differ between passes."""
    tokens, masks, keys = [], [], []
    while length > 0:
        lap, at = divmod(start, stream.total)
        take = min(length, stream.total - at)
        t, m, k = stream.read(at, at + take)
        tokens.append(t)
        masks.append(m)
        keys.append(k + lap * (1 << 40))
        start, length = start + take, length - take
    return np.concatenate(tokens), np.concatenate(masks), np.concatenate(keys)


# ---------------------------------------------------------------- pre-training windows


def window_sample(tokens: np.ndarray, keys: np.ndarray | None, trained: np.ndarray | None = None) -> Sample:
    """(inputs, labels[, document ids]) of a window of seq_len + 1 tokens, as packing makes them: with keys, labels
    stay within a document; with a trained mask, only trained tokens are labels."""
    if keys is not None:
        return packed_sample(tokens, document_runs(keys), trained)
    ids = _long(tokens)
    if trained is None:
        return ids[:-1], ids[1:]
    return packed_sample(tokens, np.zeros(len(tokens), dtype=np.int64), trained)[:2]


def _long(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


class TokenWindows(IndexedSource):
    """Windows of seq_len + 1 tokens over a text token table. In order (no shuffling) the windows run over the end
    of the data into the next pass, exactly as packing a stream of documents does (a run from token files trains
    like the same run from the raw text); shuffled, each epoch is the table's whole windows (the partial last one
    left out) in a seeded order."""

    fixed_epochs = True

    def __init__(self, name: str, table: TokenTable, seq_len: int, infinite: bool = True, documents: bool = False,
                 seed: int = 0, shuffle: bool = False):
        super().__init__(name, infinite, seed, shuffle)
        self.table = table
        self.stream = TableStream(table)
        self.window = seq_len + 1
        self.documents = documents
        self.order = self.epochs.order(self.stream.total // self.window)

    def epoch_size(self, epoch: int) -> int:
        return self.order.size

    def sample(self, index: int) -> Sample:
        if self.shuffle or not self.infinite:
            return super().sample(index)
        self._log_epoch(*divmod(index * self.window, self.stream.total))
        tokens, _, keys = read_wrapped(self.stream, index * self.window, self.window)
        return window_sample(tokens, keys if self.documents else None)

    def read(self, epoch: int, position: int) -> Sample:
        self._log_epoch(epoch, position)
        start = self.order.stored(epoch, position) * self.window
        tokens, _, keys = self.stream.read(start, start + self.window)
        return window_sample(tokens, keys if self.documents else None)


# ---------------------------------------------------------------- records


PACKINGS = ("one", "whole", "across")  # a record per sample; records whole in windows; records end to end


class RecordSource(IndexedSource):
    """Records of a token table (those `items` names, each with the documents `item_documents` gives) in the global
    order: one per sample (padded by the collate), placed whole into windows of seq_len + 1 tokens until the next
    does not fit (padding after), or end to end across windows. Shuffling permutes the records of each epoch before
    they are placed. Subclasses say which records are usable (`items`) and how a window of them becomes a sample."""

    def __init__(self, name: str, seq_len: int, packing: str, infinite: bool, seed: int, shuffle: bool):
        super().__init__(name, infinite, seed, shuffle)
        self.seq_len = seq_len
        self.packing = packing
        self._epoch_plan: tuple[int, np.ndarray, Any] | None = None
        self._window_counts: dict[int, int] = {}  # windows of each epoch packed so far (whole packing)
        self._items: np.ndarray | None = None
        self._lengths: np.ndarray | None = None

    # -- what subclasses give

    def usable(self) -> tuple[np.ndarray, np.ndarray]:
        """(the records that train, in stored order; the tokens each takes in a window)."""
        raise NotImplementedError

    def table(self) -> TokenTable:
        raise NotImplementedError

    def one(self, item: int) -> Sample:
        raise NotImplementedError

    def whole(self, items: list[int]) -> Sample:
        raise NotImplementedError

    def across(self, tokens: np.ndarray, trained: np.ndarray) -> Sample:
        raise NotImplementedError

    # -- the plan of an epoch

    def prepare(self) -> None:
        if self._items is None:
            self._items, self._lengths = self.usable()
            if self.packing == "across":
                self._stream_total = int(self._lengths.sum())

    @property
    def window(self) -> int:
        return self.seq_len + 1

    def epoch_size(self, epoch: int) -> int:
        self.prepare()
        if self.packing == "one":
            return len(self._items)
        if self.packing == "across":
            return self._stream_total // self.window
        if epoch not in self._window_counts:  # (a saved position names epoch 0's size: kept apart from the plans)
            self._window_counts[epoch] = len(self._plan(epoch)[2]) - 1
        return self._window_counts[epoch]

    def _plan(self, epoch: int) -> tuple[int, np.ndarray, Any]:
        """(epoch, its records in order, and for whole packing where each window starts (and the end), for packing
        across windows the records' stream)."""
        if self._epoch_plan is None or self._epoch_plan[0] != epoch:
            self.prepare()
            permutation = self.epochs.order(len(self._items)).epoch_order(epoch)
            order = self._items[permutation]
            placed = None
            if self.packing == "whole":
                placed = _next_fit(self._lengths[permutation], self.window)
            elif self.packing == "across":
                placed = ItemStream(self.table(), order)
            self._epoch_plan = (epoch, order, placed)
        return self._epoch_plan

    def sample(self, index: int) -> Sample:
        if self.packing == "across" and not self.shuffle and self.infinite:
            # in order, records end to end run over the end of an epoch into the next, as a stream of them does
            stream = self._plan(0)[2]
            self._log_epoch(*divmod(index * self.window, max(stream.total, 1)))
            tokens, trained, _ = read_wrapped(stream, index * self.window, self.window)
            return self.across(tokens, trained)
        return super().sample(index)

    def read(self, epoch: int, position: int) -> Sample:
        self._log_epoch(epoch, position)
        _, order, placed = self._plan(epoch)
        if self.packing == "one":
            return self.one(int(order[position]))
        if self.packing == "whole":
            return self.whole([int(i) for i in order[placed[position]:placed[position + 1]]])
        tokens, trained, _ = placed.read(position * self.window, (position + 1) * self.window)
        return self.across(tokens, trained)


def _next_fit(lengths: np.ndarray, window: int) -> np.ndarray:
    """Where each window of whole records starts (and the end): records in order until the next does not fit."""
    starts, used = [0], 0
    for k, length in enumerate(lengths.tolist()):
        if used and used + length > window:
            starts.append(k)
            used = 0
        used += length
    if len(lengths):
        starts.append(len(lengths))
    return np.array(starts, dtype=np.int64)


def trained_within(table: TokenTable, documents: np.ndarray, window: int) -> np.ndarray:
    """Whether each document has a trained token among its tokens 1..window-1 (the first token is never a label):
    one cut at the window with none is skipped."""
    starts = table.offsets[documents] + 1
    stops = np.minimum(table.offsets[documents + 1], table.offsets[documents] + window)
    found = np.zeros(len(documents), dtype=bool)
    for shard, (low, high) in enumerate(zip(table.shard_starts, table.shard_starts[1:], strict=False)):
        inside = (starts >= low) & (stops <= high) & (stops > starts)
        if not inside.any():
            continue
        mask = table.masks[shard] if table.masks is not None else np.ones(high - low, dtype=np.uint8)
        counts = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        found[inside] = counts[stops[inside] - low] > counts[starts[inside] - low]
    return found


def token_windows(dataset: str, path: str, tokenizer, seq_len: int, infinite: bool = True, key: str = "dataset_path",
                  documents: bool = False, seed: int = 0, shuffle: bool = False) -> TokenWindows:
    """Pre-training windows from the text token files at `path` (named by the config key `key`), written with the
    run's tokenizer (when one is given)."""
    table = open_token_folder(path, key)
    check_kind(table, dataset, key, key.split(".")[0])
    check_tokenizer(table, tokenizer, key)
    return TokenWindows(dataset, table, seq_len, infinite, documents, seed, shuffle)


def check_enough_windows(source: TokenWindows, ranks: int, key: str) -> None:
    """Token files hold a full window of seq_len + 1 tokens for every data-parallel rank (as check_enough_tokens
    asks of raw text)."""
    if source.epoch_size(0) < ranks:
        split = f" for each of the {ranks} data-parallel ranks" if ranks > 1 else ""
        raise ConfigError(f"'{key}' = '{source.table.folder}' holds {source.table.num_tokens} tokens: fewer than one "
                          f"sequence of seq_len + 1 = {source.window} tokens{split}; add data or lower the seq_len")
