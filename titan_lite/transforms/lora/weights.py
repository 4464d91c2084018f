"""Work on the real (possibly sharded) weights of LoRALinear modules: PiSSA's SVD initialisation, DoRA's magnitude,
loading adapter tensors, spectral re-factoring, and a bitwise checksum of the frozen weights.

Every function is collective over the ranks that hold the modules (full tensors are gathered) and gives the same
result whatever the layout: the maths runs on full float32 tensors, and each rank keeps its own shard.
"""

import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_lite.dtensor import copy_into_shard, full_tensor, local_tensor
from titan_lite.transforms.lora.module import LoRALinear, balanced_factors, dora_magnitude, principal_factors

NamedModules = list[tuple[str, LoRALinear]]


def subtract_from_shard(param: torch.Tensor, delta: torch.Tensor) -> None:
    """param -= delta (a full float32 tensor), computed in float32 and rounded once to the parameter's dtype, on
    this rank's shard only."""
    local = local_tensor(param)
    if isinstance(param, DTensor):
        delta = distribute_tensor(delta, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_((local.float() - delta).to(local.dtype))


def svd_generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    """A generator seeded by (seed, module name): a randomized SVD draws the same projection on every run."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def pissa_initialise(modules: NamedModules, niter: int | None, seed: int,
                     group: dist.ProcessGroup | None = None) -> None:
    """PiSSA on every module: A, B from the top singular triplets of the full loaded weight (exact SVD, or a seeded
    randomized one with `niter` iterations), the residual W - scale B A as the new frozen base, and copies of A, B
    kept as pissa_a0 / pissa_b0.

    The ranks of `group` (those holding the same modules: one pipeline stage) share the SVDs: module j of each round
    is decomposed by group rank j and its factors broadcast, so each SVD runs once and every rank applies the
    same factors."""
    size = group.size() if group is not None else 1
    me = group.rank() if group is not None else 0
    for start in range(0, len(modules), size):
        chunk = modules[start:start + size]
        own = None
        for j, (_, module) in enumerate(chunk):
            weight = full_tensor(module.weight.detach())  # a collective: every rank takes part in every gather
            if j == me:
                own = weight
        factors = None
        if own is not None:
            name, module = chunk[me]
            factors = principal_factors(own, module.rank, module.scale, niter,
                                        svd_generator(own.device, seed, name) if niter is not None else None)
            del own
        for j, (_, module) in enumerate(chunk):
            lora_a, lora_b = factors if j == me else _empty_factors(module)
            if size > 1:
                for t in (lora_a, lora_b):
                    dist.broadcast(t, src=dist.get_global_rank(group, j), group=group)
            _apply_pissa(module, lora_a, lora_b)


def _empty_factors(module: LoRALinear) -> tuple[torch.Tensor, torch.Tensor]:
    device = local_tensor(module.weight).device
    return (torch.empty(module.rank, module.in_features, device=device),
            torch.empty(module.out_features, module.rank, device=device))


def _apply_pissa(module: LoRALinear, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    for name, value in (("lora_a", lora_a), ("lora_b", lora_b), ("pissa_a0", lora_a), ("pissa_b0", lora_b)):
        param = getattr(module, name)
        copy_into_shard(param, value.to(param.dtype))
    subtract_from_shard(module.weight, module.scale * (lora_b @ lora_a))


@torch.no_grad()
def init_dora_magnitudes(modules: NamedModules) -> None:
    """DoRA's magnitude from the loaded weights: the row norms of W + scale B A (so DoRA starts as the base)."""
    for _, module in modules:
        norms = dora_magnitude(full_tensor(module.weight), full_tensor(module.lora_a), full_tensor(module.lora_b),
                               module.scale)
        copy_into_shard(module.magnitude, norms.to(module.magnitude.dtype))


@torch.no_grad()
def load_adapter_tensors(modules: dict[str, nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (canonical parameter names) into the parameters of the modules this rank holds."""
    for module_name, module in modules.items():
        for name, param in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}"
            if key in tensors:
                copy_into_shard(param, tensors[key].to(device=local_tensor(param).device, dtype=param.dtype))


@torch.no_grad()
def refactor_adapters(modules: NamedModules, max_spectral_norm: float | None) -> list[nn.Parameter]:
    """Replace each adapter's (A, B) by the balanced pair with the same product B A (its singular values split
    evenly), optionally capping the scaled update's largest singular value; returns the re-factored parameters."""
    changed = []
    for _, module in modules:
        cap = max_spectral_norm / module.scale if max_spectral_norm is not None else None
        lora_a, lora_b = balanced_factors(full_tensor(module.lora_a), full_tensor(module.lora_b), cap)
        copy_into_shard(module.lora_a, lora_a.to(module.lora_a.dtype))
        copy_into_shard(module.lora_b, lora_b.to(module.lora_b.dtype))
        changed += [module.lora_a, module.lora_b]
    return changed


def restart_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> None:
    """Zero the optimizer's per-parameter state (Adam's moments and step count) of these parameters."""
    for param in params:
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor):
                value.zero_()


def bits_checksum(params: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(sum, weighted sum) of the raw bits of this rank's shards, as wrapping int64: a bitwise fingerprint that
    changes when any element changes (cheap enough to take at load and at the end of training)."""
    total, weighted = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for param in params:
        bits = local_tensor(param.detach()).contiguous().view(ints[param.element_size()]).flatten().to(torch.int64)
        position = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
        total += bits.sum().cpu()
        weighted += (bits * position).sum().cpu()
    return int(total), int(weighted)
