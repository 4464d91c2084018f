"""The checkpointable data loader: global batches cut from one sample stream, each rank reading its own slice.

Global batch N is samples [N x G, (N + 1) x G) of the source's stream, where G = local batch x data-parallel degree
x accumulation steps. Its microbatch a of data-parallel rank r is the L samples starting at (a x D + r) x L. So what
a global batch holds depends only on the data and N, never on the layout; every rank reads the whole stream and
keeps its slice. The loader's state (the source's state at the end of the last global batch, and G) is the same on
every rank, so a checkpoint resumes exactly on another data-parallel degree as long as G stays the same.
"""

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_lite.config.schema import JobConfig
from titan_lite.data.datasets import Sample, SampleSource, build_packed_source
from titan_lite.data.instruct import PAD_DOCUMENT, build_instruction_source
from titan_lite.data.preference import build_preference_source
from titan_lite.errors import ConfigError
from titan_lite.loss import IGNORE_INDEX


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
    the stream), and the loader's round-robin over workers restores the order.
    """

    def __init__(self, source: SampleSource, layout: BatchLayout):
        self.source = source
        self.layout = layout
        self.start_state: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[tuple[Sample, dict[str, Any]]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        samples = self.source.samples(self.start_state)
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
                        yield sample, end_state


def pad_collate(pad_id: int, ignore_index: int, multiple: int = 1) -> Callable:
    """Collate variable-length samples: inputs padded with pad_id and labels with ignore_index (document ids, when
    the samples carry them, with PAD_DOCUMENT), to the longest sample rounded up to a multiple (context parallel
    needs lengths divisible by its chunks)."""
    def collate(items: list[tuple[Sample, dict]]) -> tuple[torch.Tensor, ...]:
        longest = max(sample[0].numel() for sample, _ in items)
        length = -(-longest // multiple) * multiple
        fills = (pad_id, ignore_index, PAD_DOCUMENT)[:len(items[0][0])]
        columns = [torch.full((len(items), length), fill, dtype=torch.long) for fill in fills]
        for row, (sample, _) in enumerate(items):
            for column, t in zip(columns, sample, strict=True):
                column[row, :t.numel()] = t
        return (*columns, items[-1][1])
    return collate


def stack_collate(items: list[tuple[tuple, dict]]) -> tuple:
    """Stack equal-length samples (input_ids, labels[, domain id]) into ([B, S], [B, S][, [B]]), with the batch's
    end state last."""
    columns = zip(*(sample for sample, _ in items), strict=True)
    return (*(torch.stack(column) for column in columns), items[-1][1])


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
    """Yields this rank's microbatches (input_ids, labels) and checkpoints a layout-independent position.

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

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """(input_ids, labels) per microbatch, plus a [B] domain-id tensor for a MixtureSource. When the source's
        sampling changes between steps (a mixture's new weights: its `version`), reading restarts from the end of the
        last consumed global batch, so batches read ahead (workers, prefetch) with the old weights are dropped."""
        while True:
            version = self._source_version()
            for *tensors, end_state in self._read_from(self.state):
                self.microbatches += 1
                if self.microbatches % self.layout.accumulation == 0:
                    self.state = end_state
                yield tuple(tensors)
                if self.microbatches % self.layout.accumulation == 0 and self._source_version() != version:
                    break
            else:
                return

    def _source_version(self) -> int:
        return getattr(self.source, "version", 0)  # only sources whose sampling can change have one

    def _read_from(self, state: dict[str, Any] | None) -> StatefulDataLoader:
        self.dataset.start_state = state
        o = self.options
        return StatefulDataLoader(self.dataset, batch_size=self.layout.local_batch, collate_fn=self.collate,
                                  num_workers=o.num_workers, pin_memory=o.pin_memory,
                                  persistent_workers=o.persistent_workers, prefetch_factor=o.prefetch_factor,
                                  multiprocessing_context=o.start_method if o.num_workers > 0 else None)

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
        self.state, self.microbatches = state["source"], 0

    def restart(self) -> None:
        """Back to the beginning of the data (a finite source's next pass)."""
        self.state, self.microbatches = None, 0

    def metrics(self) -> dict[str, float]:
        """Scalars of the data logged with the training line (RL's rollout source has some; a loader none)."""
        return {}


def build_dataloader(dataset: str, dataset_path: str | None, tokenizer, seq_len: int, layout: BatchLayout,
                     options: LoaderOptions | None = None, infinite: bool = True,
                     key_prefix: str = "training") -> DataLoader:
    """The loader of a pre-training dataset (packed windows of seq_len tokens) for this rank's layout.
    key_prefix names the config section ('training' or 'validation') in error messages."""
    return DataLoader(build_packed_source(dataset, dataset_path, tokenizer, seq_len, infinite, key_prefix), layout,
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
    return build_packed_source(s.dataset, s.dataset_path, tokenizer, s.seq_len, infinite, section, documents)


def samples_per_epoch(cfg: JobConfig, section: str, tokenizer, documents: bool = False) -> int:
    """Samples (sequences) in one pass over the section's data: what training.epochs counts in."""
    return sum(1 for _ in build_section_source(cfg, section, tokenizer, infinite=False, documents=documents)
               .samples())


def split_batch(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                           torch.Tensor | None]:
    """(inputs, labels, document ids or None, domain ids or None) of a loader batch: a source that packs documents
    adds [batch, seq] document ids after the labels, a data mixture adds [batch] domain ids last (and RL's rollouts
    [batch, seq, k] per-token values: token_values)."""
    inputs, labels, *rest = batch
    documents = next((t for t in rest if t.dim() == 2), None)
    domains = next((t for t in rest if t.dim() == 1), None)
    return inputs, labels, documents, domains


def token_values(batch: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The [batch, seq, k] per-token values a source adds for its objective (RL rollouts), or None."""
    return next((t for t in batch[2:] if t.dim() == 3), None)
