"""Global gradient-norm clipping that works for plain tensors, DTensors (FSDP/TP) and pipeline stages."""

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_lite.dtensor import full_tensor


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None) -> float:
    """Clip to max_norm (skipped when max_norm <= 0) and return the global 2-norm of all gradients.

    Pipeline stages hold disjoint parameters, so their squared norms are summed across the pp group.
    """
    if not params:
        return 0.0
    groups = by_mesh(params)
    total = global_norm([[p.grad for p in group] for group in groups])
    if pp_mesh is not None:
        total = total ** 2
        dist.all_reduce(total, group=pp_mesh.get_group())
        total = total ** 0.5
    if max_norm > 0:
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    norm = total.item()
    return norm if math.isfinite(norm) else float("nan")


def by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by their device mesh (plain tensors together): torch's norm and clipping take one mesh at
    a time, and the experts under expert parallelism live on a mesh of their own."""
    groups: dict[DeviceMesh | None, list[torch.Tensor]] = defaultdict(list)
    for param in params:
        groups[param.device_mesh if isinstance(param, DTensor) else None].append(param)
    return list(groups.values())


def global_norm(grad_groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The 2-norm of gradients (grouped by mesh) over all the ranks that shard them: a DTensor norm made global with
    full_tensor() per group."""
    norms = [full_tensor(torch.nn.utils.get_total_norm(grads, norm_type=2.0)) for grads in grad_groups]
    return norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
