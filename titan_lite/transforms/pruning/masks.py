"""Which weights a pattern prunes (lowest scores per row, per layer or per N:M group) and the mask buffers that hold
a pruned linear's kept positions through training, checkpoints and resharding."""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_lite.dtensor import local_tensor
from titan_lite.models.parameters import canonical_name

# The buffer a pruned linear carries: True where the weight is kept (torch.nn.utils.prune's convention).
MASK = "weight_mask"
# Rows sorted at once when selecting per row: bounds the sort's values and int64 indices to ~200 MB.
SORT_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Pattern:
    """unstructured (n = m = 0), or N:M: n zeros in every group of m consecutive inputs of a row."""

    n: int = 0
    m: int = 0

    @classmethod
    def parse(cls, text: str) -> "Pattern":
        if text == "unstructured":
            return cls()
        n, m = (int(v) for v in text.split(":"))
        return cls(n, m)

    @property
    def structured(self) -> bool:
        return self.m > 0

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else "unstructured"


def lowest_per_row(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Bool [rows, cols]: the `count` lowest scores of every row (ties: the lower column first)."""
    pruned = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if count == 0:
        return pruned
    rows_per_chunk = max(1, SORT_CHUNK_ELEMENTS // max(1, scores.shape[1]))
    for start in range(0, scores.shape[0], rows_per_chunk):
        pruned[start:start + rows_per_chunk] = _lowest_of_rows(scores[start:start + rows_per_chunk], count)
    return pruned


def _lowest_of_rows(chunk: torch.Tensor, count: int) -> torch.Tensor:
    """What a stable sort's first `count` columns per row select, from each row's k-th value (about twice as fast
    as sorting): every score below it, then the leftmost of those equal to it."""
    threshold = torch.kthvalue(chunk, count, dim=1, keepdim=True).values
    below = chunk < threshold
    equal = chunk == threshold
    ties_needed = count - below.sum(dim=1, keepdim=True)
    return below | (equal & (equal.cumsum(dim=1) <= ties_needed))


def lowest_in_layer(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Bool like `scores`: its `count` lowest entries over the whole tensor (ties: the earlier entry in row-major
    order first, as a stable sort orders them), found with one k-th value instead of a full sort."""
    pruned = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if count == 0:
        return pruned
    flat = scores.reshape(-1)
    threshold = torch.kthvalue(flat, count).values
    below = flat < threshold
    equal = flat == threshold
    ties_needed = count - int(below.sum())
    # The first `ties_needed` entries equal to the threshold, in order.
    equal_rank = equal.cumsum(0) if ties_needed > 0 else None
    chosen = below if equal_rank is None else below | (equal & (equal_rank <= ties_needed))
    return chosen.reshape(scores.shape)


def lowest_per_group(scores: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """Bool [rows, cols]: the n lowest scores of every group of m consecutive columns of each row."""
    rows, cols = scores.shape
    grouped = scores.reshape(rows * cols // pattern.m, pattern.m)
    return lowest_per_row(grouped, pattern.n).reshape(rows, cols)


def pruned_positions(scores: torch.Tensor, sparsity: float, pattern: Pattern, per_row: bool) -> torch.Tensor:
    """Bool [out, in], True where the weight is pruned: N:M groups, else the lowest `sparsity` of each row
    (per_row) or of the whole layer."""
    if pattern.structured:
        return lowest_per_group(scores, pattern)
    if per_row:
        return lowest_per_row(scores, int(scores.shape[1] * sparsity))
    return lowest_in_layer(scores, int(scores.numel() * sparsity))


# ------------------------------------------------------------------------------------------ buffers


def shard_like(weight: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `weight`: the same DTensor placements (only this rank's piece is kept), or as is."""
    if isinstance(weight, DTensor):
        # Every rank holds the same full tensor: slice locally, no communication.
        return distribute_tensor(full, weight.device_mesh, weight.placements, src_data_rank=None)
    return full


def all_kept_like(weight: torch.Tensor) -> torch.Tensor:
    """A mask that keeps every weight, sharded like it (a placeholder a checkpoint then fills)."""
    local = torch.ones(local_tensor(weight).shape, dtype=torch.bool, device=local_tensor(weight).device)
    if isinstance(weight, DTensor):
        return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                                  shape=weight.shape, stride=weight.stride())
    return local


def attach_mask(module: nn.Module, mask: torch.Tensor) -> None:
    """Register (or replace) the linear's persistent mask buffer; DCP saves and reshards it like the weight."""
    module.register_buffer(MASK, mask, persistent=True)


def masked_linears(model_parts: list[nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """(canonical name, module) of every linear carrying a mask."""
    for part in model_parts:
        for name, module in part.named_modules():
            if MASK in module._buffers:
                yield canonical_name(name), module


@torch.no_grad()
def apply_mask(module: nn.Module) -> None:
    """Zero the pruned weights of this rank's shard, in place."""
    local_tensor(module.weight).mul_(local_tensor(module.weight_mask))


def mask_gradient(param: torch.Tensor, module: nn.Module) -> None:
    """Post-accumulate-grad hook: zero the gradient of pruned weights (the optimizer then never moves them)."""
    if param.grad is not None:
        local_tensor(param.grad).mul_(local_tensor(module.weight_mask))


def local_counts(module: nn.Module) -> tuple[int, int, int]:
    """(weights, zero weights, nonzero weights at pruned positions) of this rank's shard."""
    weight, keep = local_tensor(module.weight), local_tensor(module.weight_mask)
    zeros = int((weight == 0).sum())
    violations = int(((weight != 0) & ~keep).sum())
    return weight.numel(), zeros, violations
