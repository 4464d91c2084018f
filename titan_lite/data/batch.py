"""The typed batch every source's loader yields (token ids, labels and the optional named fields), and how samples
become one: stacked, or padded to the longest."""

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from titan_lite.data.datasets import Deferred, Sample


@dataclass(frozen=True)
class Drawn:
    """A data mixture's sample and the id of the domain it was drawn from."""

    sample: Sample | Deferred
    domain: int

    def load(self) -> "Drawn":
        return Drawn(self.sample.load(), self.domain) if isinstance(self.sample, Deferred) else self


def loaded(sample: Sample | Deferred | Drawn) -> Sample | Drawn:
    """The sample itself, read now when it was deferred (a source that reads any sample by index)."""
    return sample.load() if isinstance(sample, (Deferred, Drawn)) else sample


@dataclass(frozen=True, eq=False)
class Batch:
    """One (micro)batch of rows. A sample's tensors are (inputs, labels[, documents]) in that order; a data mixture
    adds each row's domain, RL's rollouts each token's values."""

    inputs: torch.Tensor  # [batch, seq] token ids
    labels: torch.Tensor  # [batch, seq] next-token ids, IGNORE_INDEX where no loss
    documents: torch.Tensor | None = None  # [batch, seq] document ids of packed documents (block-causal)
    domains: torch.Tensor | None = None  # [batch] domain ids of a data mixture
    values: torch.Tensor | None = None  # [batch, seq, k] float per-token values for the objective (RL)

    @property
    def rows(self) -> int:
        return self.inputs.shape[0]

    def map(self, fn: Callable) -> "Batch":
        """fn applied to every field present (the others stay None)."""
        return Batch(**{f.name: None if (t := getattr(self, f.name)) is None else fn(t) for f in fields(self)})

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        """Page-locked copies (the loader's pin_memory calls this)."""
        return self.map(lambda t: t.pin_memory())

    def rows_of(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop) of every field."""
        return self.map(lambda t: t[start:stop])

    def split(self, rows: int) -> list["Batch"]:
        """Microbatches of `rows` rows each (the last may hold fewer), every field cut alike."""
        return [self.rows_of(start, start + rows) for start in range(0, self.rows, rows)]

    def equal(self, other: "Batch") -> bool:
        """The same fields present, each with equal values."""
        pairs = [(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)]
        return all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in pairs)


def stack_samples(samples: list[Sample | Drawn]) -> Batch:
    """Equal-length samples stacked into a Batch (a mixture's draws with their domains)."""
    drawn = isinstance(samples[0], Drawn)
    rows = [s.sample for s in samples] if drawn else samples
    columns = [torch.stack(column) for column in zip(*rows, strict=True)]
    return of_columns(columns, torch.tensor([s.domain for s in samples]) if drawn else None)


def pad_samples(samples: list[Sample], fills: tuple[int, ...], multiple: int = 1) -> Batch:
    """Variable-length samples padded to the longest, rounded up to a multiple, each tensor with its fill (in the
    samples' order: inputs, labels, documents)."""
    longest = max(sample[0].numel() for sample in samples)
    length = -(-longest // multiple) * multiple
    columns = [torch.full((len(samples), length), fill, dtype=torch.long) for fill in fills[:len(samples[0])]]
    for row, sample in enumerate(samples):
        for column, t in zip(columns, sample, strict=True):
            column[row, :t.numel()] = t
    return of_columns(columns)


def of_columns(columns: list[torch.Tensor], domains: torch.Tensor | None = None) -> Batch:
    """The Batch of a sample's stacked tensors (inputs, labels[, documents])."""
    if not 2 <= len(columns) <= 3:
        raise ValueError(f"a sample holds (inputs, labels[, documents]), not {len(columns)} tensors")
    return Batch(*columns, domains=domains)
