"""Quantizing one rank's shard of a frozen weight to torchao's NF4 tensor exactly as the whole tensor would be:
blocks of 64 with absmax scales, the scales centred on the mean over the WHOLE tensor (all-reduced over the ranks
that shard it: FSDP's all-gather rebuilds the tensor with one rank's mean) and quantized to int8 in groups of 256
(or, for a tensor whose block count 256 does not divide, of the largest power of two that does)."""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

BLOCK, SCALER_BLOCK = 64, 256
GROUP = BLOCK * SCALER_BLOCK  # elements covered by one group of double-quantized scales


def scaler_block(numel: int) -> int:
    """Scales per double-quantization group for a tensor of `numel` elements: 256 when it divides the block count,
    else the largest power of two that does (the same for every layout: it depends on the whole tensor)."""
    return math.gcd(SCALER_BLOCK, numel // BLOCK)


def _nf4():
    # torchao is needed only when a frozen base is stored in NF4: imported here, not at the top
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    return nf4_tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def is_nf4(t: torch.Tensor) -> bool:
    """Whether a tensor (or a DTensor's local shard) is torchao's NF4Tensor (checked without importing torchao)."""
    return type(_local(t)).__name__ == "NF4Tensor"


def nf4_bytes_per_element(numel: int, factor_bytes: int) -> float:
    """4 bits of code, one int8 scale per block of 64, one factor (the weight's dtype) per group of scales."""
    return 0.5 + 1 / BLOCK + factor_bytes / (BLOCK * scaler_block(numel))


def nf4_divisibility_problem(name: str, rows: int, cols: int, shards: int) -> str | None:
    """Why a [rows, cols] weight split by rows over `shards` ranks cannot be NF4 (None: it can): it must hold whole
    64-element blocks, and each shard whole groups of scales, so that the shards quantize as the whole tensor."""
    if rows * cols % BLOCK:
        return f"{name} has {rows} x {cols} elements, not a multiple of the 64-element NF4 block"
    if rows % shards:
        return f"{name} has {rows} rows, which the {shards} ranks sharding it cannot split evenly"
    group = BLOCK * scaler_block(rows * cols)
    if (rows // shards) * cols % group:
        return (f"{name}'s shard of {rows // shards} x {cols} = {rows // shards * cols:,} elements is not a multiple "
                f"of {group:,} (a group of {group // BLOCK} scales of 64-element blocks)")
    return None


def _shard_groups(param: torch.Tensor) -> list[dist.ProcessGroup]:
    """The process groups over which a DTensor's rows are split (FSDP's shard dimensions)."""
    if not isinstance(param, DTensor):
        return []
    return [param.device_mesh.get_group(i) for i, p in enumerate(param.placements) if p.is_shard()]


@torch.no_grad()
def _whole_tensor_mean(absmax: torch.Tensor, groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """The mean of the block scales over the whole tensor, summed in float64 over the shards."""
    stats = torch.stack([absmax.double().sum(), torch.tensor(float(absmax.numel()), dtype=torch.float64,
                                                               device=absmax.device)])
    for group in groups:
        dist.all_reduce(stats, group=group)
    return (stats[0] / stats[1]).to(absmax.dtype)


@torch.no_grad()
def quantize_local(local: torch.Tensor, groups: list[dist.ProcessGroup], whole_numel: int):
    """torchao's NF4Tensor of this rank's rows, with the scale mean and grouping of the whole tensor."""
    nf4 = _nf4()
    local = local.detach().contiguous()
    per_group = scaler_block(whole_numel)
    codes = nf4.to_nf4(local, BLOCK, per_group)  # the 4-bit codes use only their own block's absmax
    absmax = local.flatten().view(-1, BLOCK).abs().amax(dim=1)
    mean = _whole_tensor_mean(absmax, groups)
    centred = (absmax - mean).view(-1, per_group)
    factor = 256 / (2 * centred.abs().amax(dim=1))
    scalers = (centred * factor[:, None]).round().clamp(-128, 127).to(torch.int8).flatten()
    return nf4.NF4Tensor(*nf4.construct_nf4_args(codes, {"quantized_scalers": scalers,
                                                         "quantization_factor": factor.contiguous(),
                                                         "scaler_mean": mean}))


def quantize_param(param: torch.Tensor) -> torch.nn.Parameter:
    """A frozen parameter holding NF4 of this rank's shard (a DTensor keeps its mesh and placements)."""
    quantized = quantize_local(_local(param), _shard_groups(param), param.numel())
    if isinstance(param, DTensor):
        quantized = DTensor.from_local(quantized, param.device_mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
    return torch.nn.Parameter(quantized, requires_grad=False)


def dequantize(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense copy of an NF4 tensor (or of a DTensor's NF4 shard, as a DTensor) in `dtype`."""
    if isinstance(t, DTensor):
        dense = _local(t).get_original_weight().to(dtype)
        return DTensor.from_local(dense, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return t.get_original_weight().to(dtype)
