"""Logits split over the vocabulary (loss parallel under TP): this rank's columns and where they sit (a
VocabShard: titan_lite.loss, whose all-reduces make row maxima and sums whole), and the block size of the chunked
log-probabilities and distillation."""

import torch
from torch.distributed.tensor import DTensor

from titan_lite.loss import VocabShard

# Elements of one [rows, vocab] float32 block; a few such temporaries are alive while a block is worked on.
CHUNK_ELEMENTS = 1 << 20
ACCELERATOR_CHUNK_ELEMENTS = 1 << 23


def block_elements() -> tuple[int, int]:
    """(CPU, accelerator) elements of a block of the log-probabilities (read when called: tests shrink them)."""
    return CHUNK_ELEMENTS, ACCELERATOR_CHUNK_ELEMENTS


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
