"""DTensor helpers: the full tensor of a possibly sharded value, this rank's local piece, and copies into shards."""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole (unsharded) value: a collective for a sharded DTensor, the tensor itself otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: a DTensor's local shard, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def copy_into_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, keeping only this rank's shard when it is a DTensor."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already holds the same full tensor, so slice locally, no communication.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)
