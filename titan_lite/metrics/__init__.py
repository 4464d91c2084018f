"""Metrics: FLOP and memory accounting, the console/TensorBoard metrics processor, profiling."""

from titan_lite.metrics.flops import model_flops_per_token, num_flops_per_token, peak_flops
from titan_lite.metrics.logger import MetricsProcessor, init_logger
from titan_lite.metrics.memory import device_capacity_gib, peak_memory_gib, reset_peak
from titan_lite.metrics.profiler import maybe_enable_memory_snapshot, maybe_enable_profiling

__all__ = [
    "MetricsProcessor",
    "device_capacity_gib",
    "init_logger",
    "maybe_enable_memory_snapshot",
    "maybe_enable_profiling",
    "model_flops_per_token",
    "num_flops_per_token",
    "peak_flops",
    "peak_memory_gib",
    "reset_peak",
]
