"""The policy as rollouts see it: one narrow interface (sample these prompts) over the trained model itself, its
forward run as training runs it (the runner's context: autocast, loss parallel) and in lockstep with the other ranks
of its layout (FSDP gathers layer by layer in every decode step, TP's collectives pair up)."""

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from titan_lite.generate import Decoded, GenerationConfig, Lockstep, sample
from titan_lite.parallel.parallel_dims import ParallelDims


class Policy(Protocol):
    def sample(self, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, uniforms: torch.Tensor | None = None,
               on_step: Callable[[float], None] | None = None) -> list[Decoded]:
        """Complete each prompt (token ids); `uniforms` [prompts, max_new_tokens]: each draw's number."""
        ...


def lockstep_for(dims: ParallelDims) -> Lockstep | None:
    """What decoding on this layout needs: every rank decodes until all are done (any collective in the forward:
    FSDP, TP, EP), and forwards a multiple of the TP degree long (sequence parallelism splits them)."""
    if dims.world_size == 1:
        return None
    return Lockstep(group=None, multiple=dims.tp)


class ModelPolicy:
    """Samples from the model being trained: no second engine, no weights to sync, the same kernels as training."""

    def __init__(self, model: nn.Module, device: torch.device, lockstep: Lockstep | None = None,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.device, self.lockstep, self.context = model, device, lockstep, context

    def sample(self, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, uniforms: torch.Tensor | None = None,
               on_step: Callable[[float], None] | None = None) -> list[Decoded]:
        with self.context():
            return sample(self.model, prompts, cfg, self.device, uniforms, self.lockstep, on_step=on_step)
