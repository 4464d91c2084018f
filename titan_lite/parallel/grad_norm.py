"""Global gradient-norm clipping that works for plain tensors, DTensors (FSDP/TP) and pipeline stages."""

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None) -> float:
    """Clip to max_norm (skipped when max_norm <= 0) and return the global 2-norm of all gradients.

    DTensor gradients give a DTensor norm, made global with full_tensor(); pipeline stages hold disjoint
    parameters, so their squared norms are summed across the pp group.
    """
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if pp_mesh is not None:
        total = total ** 2
        dist.all_reduce(total, group=pp_mesh.get_group())
        total = total ** 0.5
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    norm = total.item()
    return norm if math.isfinite(norm) else float("nan")
