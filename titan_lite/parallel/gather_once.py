"""FSDP's weights gathered once for a rollout: every fully_shard group unsharded before decoding and resharded after,
instead of all-gathered layer by layer in every decode step; chosen (grpo.gather_once) where the unsharded weights
fit beside the rollout's cache on every rank."""

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger("titan_lite")
GIB = 1024**3
HEADROOM = 0.9  # of the free memory: the allocator's fragmentation and the decode step's temporaries


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unsharded_bytes(model: nn.Module, compute_bytes: int, tp: int) -> int:
    """Bytes of the model's weights once FSDP has gathered them (still split by tensor parallelism), in the dtype
    the all-gather casts them to."""
    return sum(p.numel() for p in model.parameters()) * compute_bytes // tp


def free_bytes(device: torch.device) -> int | None:
    """Memory this process may still take on the device: CUDA's free memory plus what its allocator holds unused;
    the host's available memory on a CPU; None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            return int(fields["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return None
    return None


def gathers_once(mode: str, needed: int, free: int | None, device: torch.device) -> tuple[bool, str]:
    """(gather once, why) for grpo.gather_once = always | never | auto; under auto every rank must have `needed`
    bytes (the unsharded weights beside the rollout's cache and working set) within its free memory."""
    if mode != "auto":
        return mode == "always", f"grpo.gather_once = '{mode}'"
    fits = free is not None and needed <= HEADROOM * free
    if dist.is_initialized():  # one choice for all: an all-gather per group at once, or per layer in every step
        flag = torch.tensor([int(fits)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        fits = bool(flag.item())
    room = "unknown" if free is None else f"{free / GIB:.2f} GiB"
    verb = "fit" if fits else "do not fit on every rank"
    return fits, f"auto: the unsharded weights beside the rollout's cache need {needed / GIB:.2f} GiB, {verb} in " \
                 f"{HEADROOM:.0%} of this rank's free {room}"


@contextlib.contextmanager
def gathered_once(model: nn.Module) -> Iterator[None]:
    """Every FSDP group of the model unsharded on entry (one all-gather each) and kept so through every forward;
    resharded on exit, with each group's reshard-after-forward setting as it was."""
    modules = fsdp_modules(model)
    if modules:
        modules[0]._get_fsdp_state()._lazy_init()  # the root's one-time setup, before its settings are saved
    saved = [_reshard_setting(m) for m in modules]
    try:
        for module in modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        yield
    finally:
        for module, setting in zip(modules, saved, strict=True):
            _restore_reshard_setting(module, setting)
            module.reshard()


@contextlib.contextmanager
def resharded(model: nn.Module) -> Iterator[None]:
    """Every FSDP group of the model resharded on entry and on exit: no gathered copy from before (a forward without
    a backward leaves groups that do not reshard after forward gathered) is used inside, and none made inside
    (of weights changed for the rollout, such as folded adapters) outlives it."""
    modules = fsdp_modules(model)
    for module in modules:
        module.reshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()


def _reshard_setting(module: FSDPModule) -> tuple:
    # FSDP2 has a setter for reshard_after_forward but no getter: read the state it sets, to restore it exactly.
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]


def _restore_reshard_setting(module: FSDPModule, setting: tuple) -> None:
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward, infos = setting
    for group, info in zip(state._fsdp_param_groups, infos, strict=True):
        group.post_forward_mesh_info = info
