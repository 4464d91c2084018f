"""DTensor helpers: the full tensor of a possibly sharded value, this rank's local piece (or share of a replicated
value), and copies into shards."""

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole (unsharded) value: a collective for a sharded DTensor, the tensor itself otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: a DTensor's local shard, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_share(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's share of `t` split evenly along `dim` (of a 1-D mesh): a replicated DTensor is sliced locally, no
    communication (its gradient is gathered back in backward); a plain tensor is returned whole."""
    if not isinstance(t, DTensor):
        return t
    return t.redistribute(t.device_mesh, (Shard(dim),)).to_local()


def replicated_like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A plain tensor every rank holds whole, as a replicated DTensor on ref's mesh where ref is a DTensor (so the two
    combine); t itself otherwise."""
    if not isinstance(ref, DTensor):
        return t
    return DTensor.from_local(t, ref.device_mesh, (Replicate(),) * ref.device_mesh.ndim, run_check=False)


def copy_into_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, keeping only this rank's shard when it is a DTensor."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already holds the same full tensor, so slice locally, no communication.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)
