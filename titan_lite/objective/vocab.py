"""Logits split over the vocabulary (loss parallel under TP): this rank's columns and where they sit, the
all-reduces that make row maxima and sums whole, and the blocks of rows the chunked losses work on."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Elements of one [rows, vocab] float32 block; a few such temporaries are alive while a block is worked on.
CHUNK_ELEMENTS = 1 << 20
ACCELERATOR_CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class VocabShard:
    """This rank's columns [offset, offset + width) of a vocabulary split over `group` (None: the whole of it)."""

    offset: int = 0
    group: dist.ProcessGroup | None = None

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

    def local_labels(self, labels: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels as column indices of this shard, 0 where outside it; whether each label is in this shard)."""
        inside = (labels >= self.offset) & (labels < self.offset + width)
        return torch.where(inside, labels - self.offset, 0), inside


def local_vocab_shard(logits: torch.Tensor) -> tuple[torch.Tensor, VocabShard]:
    """This rank's vocab columns of logits [..., vocab] (a plain tensor: all of them) and where they sit; DTensor
    logits that are not split over the vocab on a 1-D mesh are gathered whole (differentiably)."""
    if not isinstance(logits, DTensor):
        return logits, VocabShard()
    placements = logits.placements
    if logits.device_mesh.ndim != 1 or not (placements[0].is_shard() and placements[0].dim in (-1, logits.ndim - 1)):
        return logits.full_tensor(), VocabShard()
    mesh = logits.device_mesh
    vocab, ranks, rank = logits.shape[-1], mesh.size(), mesh.get_local_rank()
    chunk = -(-vocab // ranks)  # torch.chunk's split, as Shard places uneven vocabularies
    return logits.to_local(), VocabShard(min(rank * chunk, vocab), mesh.get_group())


def row_blocks(rows: int, width: int, device: torch.device, elements: tuple[int, int] | None = None) -> list[slice]:
    """Slices of rows whose [rows, width] float32 block holds about CHUNK_ELEMENTS (ACCELERATOR_CHUNK_ELEMENTS off
    the CPU; `elements`: another (CPU, accelerator) pair)."""
    cpu, accelerator = elements or (CHUNK_ELEMENTS, ACCELERATOR_CHUNK_ELEMENTS)
    step = max(1, (cpu if device.type == "cpu" else accelerator) // max(1, width))
    return [slice(start, start + step) for start in range(0, rows, step)]
