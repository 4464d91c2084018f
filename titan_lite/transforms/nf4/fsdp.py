"""Swapping a parameter FSDP2 already manages for its NF4 version: FSDP decides at fully_shard whether a parameter
gathers through its tensor's own hooks (torchao's NF4 sends its 4-bit codes), so its record is refreshed here."""

from torch import nn
from torch.distributed.fsdp import FSDPModule


def fsdp_records(model_parts: list[nn.Module]) -> dict[int, object]:
    """id(sharded parameter) -> FSDP2's record of it (FSDPParam), for every fully_shard group of the parts."""
    records = {}
    for part in model_parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            for record in group.fsdp_params if group is not None else []:
                records[id(record.sharded_param)] = record
    return records


def swap_parameter(module: nn.Module, local_name: str, new: nn.Parameter, records: dict[int, object]) -> None:
    """Register `new` in place of the module's parameter, and make FSDP gather `new` (through its own all-gather
    hooks) when FSDP manages the old one."""
    old = getattr(module, local_name)
    module.register_parameter(local_name, new)
    record = records.pop(id(old), None)
    if record is None:
        return
    record.sharded_param = new
    record._init_extensions()  # NF4's fsdp_pre_all_gather / fsdp_post_all_gather
    # FSDP's own reset compares storages when the flat shard is a plain tensor; an NF4 wrapper has no storage
    record._sharded_param_data = new._local_tensor.view(-1)
    record.reset_sharded_param()
    records[id(new)] = record
