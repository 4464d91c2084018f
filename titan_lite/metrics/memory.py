"""Device memory readings: peak usage (accelerator allocator stats, or process peak RSS on CPU), the peak of live
tensor bytes over a stretch of work (allocator on accelerators, a dispatch mode on CPU), and capacity."""

import contextlib
import resource
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError

GIB = 1024**3
DEFAULT_DEVICE_MEMORY_GIB = 80.0


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


def device_memory_gib(cfg: JobConfig) -> float:
    """--dry_run.device_memory_gib, else the visible accelerator's memory, else 80 GiB."""
    if cfg.dry_run.device_memory_gib is not None:
        if cfg.dry_run.device_memory_gib <= 0:
            raise ConfigError(f"'dry_run.device_memory_gib' must be positive, got {cfg.dry_run.device_memory_gib}")
        return float(cfg.dry_run.device_memory_gib)
    if torch.accelerator.is_available():
        capacity = device_capacity_gib(torch.accelerator.current_accelerator())
        if capacity:
            return capacity
    return DEFAULT_DEVICE_MEMORY_GIB


# ------------------------------------------------------------------------------ peak of live tensors


def plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding a tensor's memory: itself, or a DTensor's (or other wrapper's) inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from plain_tensors(inner)
    else:
        yield t


class LiveTensorPeak(TorchDispatchMode):
    """The peak, over the ops run while active, of the bytes of live tensor storages: the baseline tensors' (alive
    throughout) plus every storage an op produced, for as long as it lives. On CPU, where no allocator keeps
    statistics, this is what an accelerator's peak measures. Sizes are read when an op produces or returns a
    storage, and re-read every RECOUNT_OPS ops (FSDP frees a gathered parameter by shrinking its storage)."""

    RECOUNT_OPS = 64

    def __init__(self, baseline: Iterable[torch.Tensor]):
        super().__init__()
        storages = {inner.untyped_storage().data_ptr(): inner.untyped_storage().nbytes()
                    for t in baseline for inner in plain_tensors(t)}
        self.baseline_ptrs = set(storages)
        self.baseline_bytes = sum(storages.values())
        self.sizes: dict[int, int] = {}  # id(storage) -> bytes when last seen
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.ops = 0
        self.peak = self.baseline_bytes

    def _died(self, key: int, _ref) -> None:
        self.live -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def _see(self, storage: torch.UntypedStorage) -> None:
        if storage.data_ptr() in self.baseline_ptrs:
            return
        key, size = id(storage), storage.nbytes()
        if key not in self.refs:
            self.refs[key] = weakref.ref(storage, partial(self._died, key))
        self.live += size - self.sizes.get(key, 0)
        self.sizes[key] = size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view shares its input's storage
            return out
        if type(out) is torch.Tensor:  # the common case, without the tree walk
            self._see(out.untyped_storage())
        else:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    for inner in plain_tensors(t):
                        self._see(inner.untyped_storage())
        self.ops += 1
        if self.ops % self.RECOUNT_OPS == 0:
            for ref in list(self.refs.values()):
                storage = ref()
                if storage is not None:
                    self._see(storage)
        self.peak = max(self.peak, self.baseline_bytes + self.live)
        return out


@dataclass
class PeakReading:
    """Filled when the measured stretch ends: peak bytes of live tensors on the device, and how it was read."""

    bytes: int = 0
    source: str = ""


@contextlib.contextmanager
def measure_peak(device: torch.device, baseline: Iterable[torch.Tensor]) -> Iterator[PeakReading]:
    """Peak tensor bytes on `device` during the block: the allocator's peak on an accelerator (everything it holds),
    on CPU the baseline tensors plus every tensor created inside (LiveTensorPeak)."""
    reading = PeakReading()
    if device.type == "cpu":
        tracker = LiveTensorPeak(baseline)
        with tracker:
            yield reading
        reading.bytes, reading.source = tracker.peak, "live CPU tensors"
        return
    module = _device_module(device)
    module.reset_peak_memory_stats(device)
    yield reading
    reading.bytes, reading.source = module.max_memory_allocated(device), f"{device.type} allocator"
