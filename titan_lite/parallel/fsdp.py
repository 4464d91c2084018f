"""FSDP2 / HSDP: fully_shard per block, embeddings, head and root, with mixed precision, resharding and CPU offload."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_lite.config.schema import JobConfig
from titan_lite.distributed import compute_dtype
from titan_lite.errors import ConfigError
from titan_lite.parallel.parallel_dims import ParallelDims


def data_parallel_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """1-D fsdp mesh for FSDP; 2-D (dp_replicate, fsdp) for HSDP, and for pure replication (shard size 1)."""
    if parallel_dims.dp_replicate_enabled:
        return parallel_dims.mesh["dp_replicate", "fsdp"]
    return parallel_dims.submesh("fsdp")


def mixed_precision_policy(cfg: JobConfig, device_type: str) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=compute_dtype(cfg.training.mixed_precision_param, device_type),
                                reduce_dtype=getattr(torch, cfg.training.mixed_precision_reduce))


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """default: free gathered parameters after forward, except under PP where microbatches reuse them."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not pp_enabled


def offload_policy(enable: bool, device_type: str) -> OffloadPolicy:
    """CPU offload of sharded parameters, gradients and optimizer state; pinned memory exists only with accelerators."""
    if not enable:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, cfg: JobConfig, pp_enabled: bool) -> None:
    """Shard each block, then the embeddings, then norm + head together, then the root (whatever is left)."""
    reshard = reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, pp_enabled)
    offload = offload_policy(cfg.training.enable_cpu_offload, dp_mesh.device_type)
    common = dict(mesh=dp_mesh, mp_policy=mixed_precision_policy(cfg, dp_mesh.device_type), offload_policy=offload)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard, **common)
    emb, norm, out = (getattr(model, name, None) for name in ("tok_embeddings", "norm", "output"))
    # A tied embedding and head share one parameter, which must live in one group: the root's.
    tied = emb is not None and out is not None and emb.weight is out.weight
    if emb is not None and not tied:
        fully_shard(emb, reshard_after_forward=reshard, **common)
    head = [m for m in (norm, out) if m is not None]
    if head and not tied:
        # The backward starts with the head right after forward: keep it gathered unless told to always reshard.
        fully_shard(head, reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward == "always", **common)
    fully_shard(model, reshard_after_forward=reshard, **common)


def check_cpu_offload(cfg: JobConfig, parallel_dims: ParallelDims) -> None:
    """CPU offload is an FSDP policy: refuse it when no data-parallel sharding or replication is applied."""
    if cfg.training.enable_cpu_offload and not (parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled):
        raise ConfigError("'training.enable_cpu_offload' = true needs FSDP: a data-parallel shard or replicate degree "
                          f"above 1, but the layout is {parallel_dims.describe()}")
