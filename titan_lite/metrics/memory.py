"""Device memory readings: peak usage (accelerator allocator stats, or process peak RSS on CPU) and capacity."""

import resource
import sys
from types import ModuleType

import torch

GIB = 1024**3


def _device_module(device: torch.device) -> ModuleType:
    """The torch.<device> module with allocator stats (torch.cuda, torch.xpu, ...), else torch.accelerator."""
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "memory_stats"):
        return module
    return torch.accelerator


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process; ru_maxrss is KiB on Linux but bytes on macOS."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def peak_memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak active, peak reserved) GiB since the last reset_peak on an accelerator.

    On CPU both are the process peak RSS, which the OS never resets, so it is a since-start peak.
    """
    if device.type == "cpu":
        rss = _peak_rss_bytes() / GIB
        return rss, rss
    module = _device_module(device)
    stats = module.memory_stats(device)
    active = stats.get("active_bytes.all.peak", stats.get("allocated_bytes.all.peak", 0))
    reserved = stats.get("reserved_bytes.all.peak", module.max_memory_reserved(device))
    return active / GIB, reserved / GIB


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window on an accelerator (no-op on CPU: peak RSS cannot be reset)."""
    if device.type != "cpu":
        _device_module(device).reset_peak_memory_stats(device)


def device_capacity_gib(device: torch.device) -> float | None:
    """Total memory of the accelerator in GiB; None on CPU."""
    if device.type == "cpu":
        return None
    module = _device_module(device)
    if hasattr(module, "get_device_properties"):
        return module.get_device_properties(device).total_memory / GIB
    return torch.accelerator.get_memory_info(device)[1] / GIB
