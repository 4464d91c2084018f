"""The checkpointable data loader: global batches cut from one sample stream, each rank reading its own slice.

Global batch N is samples [N x G, (N + 1) x G) of the source's stream, where G = local batch x data-parallel degree
x accumulation steps. Its microbatch a of data-parallel rank r is the L samples starting at (a x D + r) x L. So what
a global batch holds depends only on the data and N, never on the layout. A source that hands out any sample by its
index (token files; instruction and preference rows: data/indexed.py) is read only at this rank's samples, by each
worker only at its own, so a rank's cost does not grow with D; a raw-text stream is read whole by every rank, which
keeps its slice. With `num_workers = N` on raw text whose tokenizer releases the GIL (tiktoken, sentencepiece, a
tokenizer.json BPE on tiktoken's core), one worker process reads the stream once and N threads in it share the
tokenizing (the same windows, in the same order); otherwise each of the N workers reads the whole stream. The
loader's state (the source's state at the end of the last global batch, and G) is the same on every rank, so a
checkpoint resumes exactly on another data-parallel degree as long as G stays the same.
"""

import itertools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_lite.config.schema import JobConfig
from titan_lite.data.batch import Batch, Drawn, loaded, pad_samples, stack_samples
from titan_lite.data.datasets import (
    PackedSource,
    Sample,
    SampleSource,
    build_packed_source,
    dataset_root,
)
from titan_lite.data.indexed import IndexedSource, RecordSource, TokenWindows, token_windows
from titan_lite.data.instruct import PAD_DOCUMENT, build_instruction_source
from titan_lite.data.order import data_order
from titan_lite.data.preference import build_preference_source
from titan_lite.data.token_files import is_token_folder
from titan_lite.errors import ConfigError
from titan_lite.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch is cut: L samples per microbatch, D data-parallel ranks, A microbatches per rank."""

    local_batch: int
    dp_rank: int
    dp_degree: int
    accumulation: int = 1

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.dp_degree * self.accumulation

    def keeps(self, index: int) -> tuple[int, int] | None:
        """(microbatch, position in it) of sample `index` of a global batch on this rank, or None."""
        row, pos = divmod(index, self.local_batch)
        microbatch, rank = divmod(row, self.dp_degree)
        return (microbatch, pos) if rank == self.dp_rank else None


class GlobalBatchSlices(IterableDataset):
    """This rank's samples of every global batch, microbatch by microbatch, each with the source's state at the end
    of its global batch. A global batch is read whole before any of it is handed out, and an incomplete last one
    (finite sources) is dropped, so every rank yields the same number of microbatches.

    With DataLoader workers, worker w produces the rank's microbatches k with k % workers == w (each worker reads
    the stream, or only its samples of an IndexedSource), and the loader's round-robin over workers restores the
    order. `encoders` > 1: a PackedSource's documents are encoded by that many threads (in the one worker).
    """

    def __init__(self, source: SampleSource, layout: BatchLayout):
        self.source = source
        self.layout = layout
        self.start_state: dict[str, Any] | None = None
        self.encoders = 1

    def __iter__(self) -> Iterator[tuple[Sample | Drawn, dict[str, Any]]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if isinstance(self.source, IndexedSource):
            yield from self._by_index(worker, workers)
            return
        samples = self.source.samples(self.start_state, encoders=self.encoders) if self.encoders > 1 else \
            self.source.samples(self.start_state)
        for batch_index in itertools.count():
            batch = list(itertools.islice(samples, self.layout.global_batch))
            if len(batch) < self.layout.global_batch:
                return
            end_state = batch[-1][1]
            mine: list[list[Sample]] = [[] for _ in range(self.layout.accumulation)]
            for index, (sample, _) in enumerate(batch):
                kept = self.layout.keeps(index)
                if kept is not None:
                    mine[kept[0]].append(sample)
            for a, microbatch in enumerate(mine):
                if (batch_index * self.layout.accumulation + a) % workers == worker:
                    for sample in microbatch:
                        yield loaded(sample), end_state

    def _by_index(self, worker: int, workers: int) -> Iterator[tuple[Sample, dict[str, Any]]]:
        """This worker's microbatches of this rank, each sample read by its index and nothing else read."""
        source, layout = self.source, self.layout
        first, total, size = source.seek(self.start_state), source.total(), layout.global_batch
        for batch_index in itertools.count():
            start = first + batch_index * size
            if total is not None and start + size > total:
                return
            end_state = None
            for a in range(layout.accumulation):
                if (batch_index * layout.accumulation + a) % workers != worker:
                    continue
                end_state = end_state or source.state_at(start + size)
                row = (a * layout.dp_degree + layout.dp_rank) * layout.local_batch
                for position in range(layout.local_batch):
                    yield source.sample(start + row + position), end_state


def pad_collate(pad_id: int, ignore_index: int, multiple: int = 1) -> Callable:
    """Collate variable-length samples into a Batch: inputs padded with pad_id and labels with ignore_index
    (document ids, when the samples carry them, with PAD_DOCUMENT), to the longest sample rounded up to a multiple
    (context parallel needs lengths divisible by its chunks); the batch's end state beside it."""
    def collate(items: list[tuple[Sample, dict]]) -> tuple[Batch, dict]:
        return pad_samples([sample for sample, _ in items], (pad_id, ignore_index, PAD_DOCUMENT), multiple), \
            items[-1][1]
    return collate


def stack_collate(items: list[tuple[Sample | Drawn, dict]]) -> tuple[Batch, dict]:
    """Stack equal-length samples (a data mixture's draws with their domains) into a Batch, with the batch's end
    state beside it."""
    return stack_samples([sample for sample, _ in items]), items[-1][1]


@dataclass(frozen=True)
class AsArrays:
    """A collate whose tensors come out as numpy arrays (DataLoader.__iter__ turns them back, without a copy)."""

    collate: Callable

    def __call__(self, items: list) -> tuple[Batch, dict]:
        batch, end_state = self.collate(items)
        return batch.map(torch.Tensor.numpy), end_state


@dataclass
class LoaderOptions:
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    # How worker processes start: None = the multiprocessing default (fork on Linux). The tests start theirs from a
    # forkserver: forking a pytest-xdist worker, whose threads may hold a lock at that moment, once hung a worker.
    start_method: str | None = None


class DataLoader:
    """Yields this rank's microbatches (Batch) and checkpoints a layout-independent position.

    state_dict() must be taken between steps (after whole global batches), as the trainer's checkpoints are.
    """

    def __init__(self, source: SampleSource, layout: BatchLayout, options: LoaderOptions | None = None,
                 collate: Callable = stack_collate):
        self.source = source
        self.layout = layout
        self.dataset = GlobalBatchSlices(source, layout)
        self.options = options or LoaderOptions()
        self.collate = collate
        self.state: dict[str, Any] | None = None  # the source's state at the end of the last global batch consumed
        self.microbatches = 0
        streams = getattr(source, "sources", [source])  # a data mixture's domains
        if self.options.num_workers > 1 and any(isinstance(s, PackedSource) for s in streams):
            logger.info("DataLoader: %s", describe_workers(source, self.options.num_workers))

    def __iter__(self) -> Iterator[Batch]:
        """A Batch per microbatch (with its domains for a MixtureSource). When the source's
        sampling changes between steps (a mixture's new weights: its `version`), reading restarts from the end of the
        last consumed global batch, so batches read ahead (workers, prefetch) with the old weights are dropped."""
        while True:
            version = self._source_version()
            for batch, end_state in self._read_from(self.state):
                self.microbatches += 1
                if self.microbatches % self.layout.accumulation == 0:
                    self.state = end_state
                yield batch.map(lambda t: torch.from_numpy(t) if isinstance(t, np.ndarray) else t)
                if self.microbatches % self.layout.accumulation == 0 and self._source_version() != version:
                    break
            else:
                return

    def _source_version(self) -> int:
        return getattr(self.source, "version", 0)  # only sources whose sampling can change have one

    def _read_from(self, state: dict[str, Any] | None) -> StatefulDataLoader:
        self.dataset.start_state = state
        if isinstance(self.source, IndexedSource):
            self.source.prepare()  # before workers start: they share (fork) or carry (spawn) the work done
        o = self.options
        workers, prefetch = o.num_workers, o.prefetch_factor
        self.dataset.encoders = 1
        if shares_tokenizing(self.source, o.num_workers):
            # one worker reads the stream, N threads in it encode; as many batches in flight as N workers would hold
            self.dataset.encoders, workers, prefetch = o.num_workers, 1, (prefetch or 2) * o.num_workers
        # Batches cross from worker processes as numpy arrays, pickled by value: a shared-memory segment per tensor
        # costs more than copying a batch (pinned memory needs tensors: then they stay tensors)
        collate = self.collate if workers == 0 or o.pin_memory else AsArrays(self.collate)
        return StatefulDataLoader(self.dataset, batch_size=self.layout.local_batch, collate_fn=collate,
                                  num_workers=workers, pin_memory=o.pin_memory,
                                  persistent_workers=o.persistent_workers, prefetch_factor=prefetch,
                                  multiprocessing_context=o.start_method if workers > 0 else None)

    def state_dict(self) -> dict[str, Any]:
        if self.microbatches % self.layout.accumulation:
            raise RuntimeError("the data position is defined between global batches only")
        return {"source": self.state, "global_batch": self.layout.global_batch, "dataset": self.source.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["global_batch"] != self.layout.global_batch:
            raise ConfigError(
                f"the checkpoint's data position is for global batches of {state['global_batch']} sequences, this run "
                f"has {self.layout.global_batch} ('training.local_batch_size' {self.layout.local_batch} x "
                f"data-parallel degree {self.layout.dp_degree} x accumulation {self.layout.accumulation}); set "
                f"'training.global_batch_size' to {state['global_batch']} to continue the same run")
        if isinstance(self.source, IndexedSource):
            self.source.seek(state["source"])  # a position of another order (data, shuffle, seed) is one line now
        self.state, self.microbatches = state["source"], 0

    def restart(self) -> None:
        """Back to the beginning of the data (a finite source's next pass)."""
        self.state, self.microbatches = None, 0

    def metrics(self) -> dict[str, float]:
        """Scalars of the data logged with the training line (RL's rollout source has some; a loader none)."""
        return {}


def pretraining_source(dataset: str, dataset_path: str | None, tokenizer, seq_len: int, infinite: bool = True,
                       key_prefix: str = "training", documents: bool = False, seed: int = 0,
                       shuffle: bool = False) -> SampleSource:
    """Windows of seq_len + 1 tokens: from token files (by index; shuffled per epoch when asked), or packed from a
    raw-text stream in order."""
    if is_token_folder(dataset_path):
        dataset_root(dataset, dataset_path, key_prefix)  # a known dataset name, as for raw text
        return token_windows(dataset, dataset_path, tokenizer, seq_len, infinite, f"{key_prefix}.dataset_path",
                             documents, seed, shuffle)
    return build_packed_source(dataset, dataset_path, tokenizer, seq_len, infinite, key_prefix, documents)


def build_dataloader(dataset: str, dataset_path: str | None, tokenizer, seq_len: int, layout: BatchLayout,
                     options: LoaderOptions | None = None, infinite: bool = True,
                     key_prefix: str = "training") -> DataLoader:
    """The loader of a pre-training dataset (windows of seq_len tokens, from raw text or token files) for this
    rank's layout. key_prefix names the config section ('training' or 'validation') in error messages."""
    return DataLoader(pretraining_source(dataset, dataset_path, tokenizer, seq_len, infinite, key_prefix), layout,
                      options)


def loader_options(cfg) -> LoaderOptions:
    """From a [*.dataloader] config section."""
    return LoaderOptions(cfg.num_workers, cfg.pin_memory, cfg.persistent_workers, cfg.prefetch_factor)


def build_section_loader(cfg: JobConfig, section: str, tokenizer, layout: BatchLayout, infinite: bool = True,
                         length_multiple: int = 1, documents: bool = False) -> DataLoader:
    """The loader of [training] or [validation]'s dataset: packed pre-training windows, or instruction examples
    (dataset 'instruct', padded to the longest of each batch rounded up to length_multiple, unless packed), or
    preference pairs (packed whole into windows, or one per sequence, padded alike).
    `documents` (block-causal attention): packed windows carry document ids."""
    s = getattr(cfg, section)
    source = build_section_source(cfg, section, tokenizer, infinite, documents)
    padded = (s.dataset == "instruct" and not cfg.instruct.packing) or \
        (s.dataset == "preference" and not cfg.preference.packing)
    if padded:
        pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else tokenizer.eos_id
        # sequence parallelism splits the sequence over the TP ranks: padded lengths must divide by its degree
        multiple = math.lcm(length_multiple, cfg.parallelism.tensor_parallel_degree)
        return DataLoader(source, layout, loader_options(s.dataloader),
                          collate=pad_collate(pad_id, IGNORE_INDEX, multiple))
    return DataLoader(source, layout, loader_options(s.dataloader))


def build_section_source(cfg: JobConfig, section: str, tokenizer, infinite: bool = True,
                         documents: bool = False) -> SampleSource:
    """The sample stream of [training] or [validation]'s dataset (instruction examples or packed windows)."""
    s = getattr(cfg, section)
    if s.dataset == "instruct":
        return build_instruction_source(cfg, section, tokenizer, infinite, documents)
    if s.dataset == "preference":
        return build_preference_source(cfg, section, tokenizer, infinite)
    where = f"'{section}.dataset_path' = '{s.dataset_path or s.dataset}'"
    seed, shuffle = data_order(cfg, section, is_token_folder(s.dataset_path), where)
    return pretraining_source(s.dataset, s.dataset_path, tokenizer, s.seq_len, infinite, section, documents, seed,
                              shuffle)


def samples_per_epoch(cfg: JobConfig, section: str, tokenizer, documents: bool = False) -> int:
    """Samples (sequences) in one pass over the section's data: what training.epochs counts in (the first epoch's,
    where whole records packed in a shuffled order make epochs of different sizes)."""
    source = build_section_source(cfg, section, tokenizer, infinite=False, documents=documents)
    if isinstance(source, IndexedSource):
        return source.epoch_size(0)
    return sum(1 for _ in source.samples())


def describe_source(source: SampleSource, layout: BatchLayout) -> str:
    """How a rank reads its data, for the run's log and DRY_RUN: by index (each rank its own sequences), or a
    raw-text stream every rank reads whole."""
    mine = layout.local_batch * layout.accumulation
    own = (f"each rank reads only its {mine} of the {layout.global_batch} sequences of a step (each DataLoader worker "
           "only its own)")
    if isinstance(source, TokenWindows):
        order = "shuffled per epoch" if source.shuffle else "in order"
        return (f"token files '{source.table.folder}' ({source.table.num_tokens:,} tokens, "
                f"{source.epoch_size(0):,} sequences per epoch, {order}): {own}")
    if isinstance(source, RecordSource):
        stored = getattr(source.file, "table", None)
        where = f"token files '{stored.folder}'" if stored is not None else \
            f"'{source.file.path}' (tokenized once when the run starts)"
        order = "shuffled per epoch" if source.shuffle else "in order"
        return f"{source.name} rows from {where}, {order}: {own}"
    streams = getattr(source, "sources", [source])
    raw = [_where(s) for s in streams if not isinstance(s, IndexedSource)]
    if not raw:
        return f"data mixture of token files ({', '.join(s.name for s in streams)}): each rank walks the draws and " \
               f"reads only its {mine} of the {layout.global_batch} sequences of a step"
    return (f"raw text ({', '.join(raw)}) read in order as a stream: every rank reads and tokenizes all "
            f"{layout.global_batch} sequences of a step and keeps its {mine} (tokenize once with "
            "scripts/tokenize_data.py to read only its own, and to shuffle)")


def _where(source: SampleSource) -> str:
    """A raw-text source's file, or the folder of its files."""
    shards = source.stream.shards
    return f"'{shards[0] if len(shards) == 1 else shards[0].parent}'"


def shares_tokenizing(source: SampleSource, num_workers: int) -> bool:
    """Whether N > 1 DataLoader workers of a raw-text stream become N encoding threads in one worker: its tokenizer
    must release the GIL (a data mixture's raw-text domains keep one stream per worker)."""
    return num_workers > 1 and isinstance(source, PackedSource) and getattr(source.tokenizer, "releases_gil", False)


def describe_workers(source: SampleSource, num_workers: int) -> str:
    """What N DataLoader workers do for a source read as a stream, for the run's log."""
    if shares_tokenizing(source, num_workers):
        return (f"one worker process reads raw text '{source.name}' once and {num_workers} threads in it share the "
                f"tokenizing ({source.tokenizer.backend}; num_workers = {num_workers})")
    if isinstance(source, PackedSource):
        why = f"its tokenizer ({getattr(source.tokenizer, 'backend', type(source.tokenizer).__name__)}) holds " \
              "Python's GIL, so threads would not share the work"
    else:
        why = "a data mixture's raw-text domains are read by each worker"
    return (f"each of the {num_workers} workers reads and tokenizes the whole raw-text stream ({why}): no faster "
            "than one worker; tokenize once with scripts/tokenize_data.py to share the reading")


def reads_by_index(source: SampleSource) -> bool:
    """Whether each rank reads only its own samples (token files, rows; a mixture of token files only)."""
    return all(isinstance(s, IndexedSource) for s in getattr(source, "sources", [source]))
