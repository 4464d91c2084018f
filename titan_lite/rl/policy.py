"""The policy as rollouts see it: one narrow interface (sample these prompts) over the trained model itself, its
forward run as training runs it (the runner's context: autocast, loss parallel), decoded by the decode engine
(generate/engine.py: continuous batching, a group's prompt prefilled once) on every layout: alone where the forward
issues no collectives (one process, FSDP's weights gathered once without TP, CP or EP), else in lockstep with the
other ranks (FSDP gathering layer by layer, TP, CP, EP)."""

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from titan_lite.generate import Decoded, GenerationConfig, Lockstep
from titan_lite.generate.engine import decode_slots
from titan_lite.parallel.parallel_dims import ParallelDims


class Policy(Protocol):
    def sample(self, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, uniforms: torch.Tensor | None = None,
               on_step: Callable[[float], None] | None = None) -> list[Decoded]:
        """Complete each prompt (token ids); `uniforms` [prompts, max_new_tokens]: each draw's number."""
        ...


def lockstep_for(dims: ParallelDims, gathered_once: bool = False) -> Lockstep | None:
    """What decoding on this layout needs: every rank's forwards paired (any collective in the forward: FSDP
    gathering layer by layer, TP, CP, EP), each a multiple of the TP degree long (sequence parallelism splits it);
    None where the forward issues none (one process, or FSDP's weights gathered once and nothing else sharded)."""
    if dims.world_size == 1 or (gathered_once and dims.tp == dims.cp == 1 and not dims.ep_enabled):
        return None
    return Lockstep(group=None, multiple=dims.tp)


class ModelPolicy:
    """Samples from the model being trained: no second engine, no weights to sync, the same kernels as training.
    `lockstep()`: the layout's lockstep, asked inside `context` (which may gather FSDP's weights once)."""

    def __init__(self, model: nn.Module, device: torch.device, lockstep: Callable[[], Lockstep | None],
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.device, self.lockstep, self.context = model, device, lockstep, context

    def sample(self, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, uniforms: torch.Tensor | None = None,
               on_step: Callable[[float], None] | None = None) -> list[Decoded]:
        with self.context():
            return decode_slots(self.model, prompts, cfg, self.device, uniforms, on_step=on_step,
                                lockstep=self.lockstep())
