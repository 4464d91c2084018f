"""FSDP2's all-gather for backends without float8 dtypes (gloo): the same bytes moved as uint8."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

FLOAT8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype in FLOAT8_DTYPES else tensor


class ByteAllGather(DefaultAllGather):
    """FSDP2's default all-gather with float8 buffers viewed as uint8 (a 1-byte dtype every backend has)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return dist.all_gather_single(as_bytes(output_tensor), as_bytes(input_tensor), group=group,
                                      async_op=async_op)


def lacks_float8(module: FSDPModule) -> bool:
    """gloo (the CPU backend) has no float8 dtype; nccl has."""
    mesh = module._get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh
    return mesh.device_type == "cpu"


def install_byte_all_gather(model: nn.Module) -> int:
    """Give every FSDP module of the part whose backend lacks float8 the byte all-gather; returns how many."""
    installed = 0
    for module in model.modules():
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups and lacks_float8(module):
            module.set_custom_all_gather(ByteAllGather())
            installed += 1
    return installed
