"""The policy as rollouts see it: one narrow interface (sample these prompts) over the trained model itself, its
forward run as training runs it (the runner's context: autocast, loss parallel): on one process by the decode engine
(generate/engine.py: continuous batching, a group's prompt prefilled once), and in lockstep with the other ranks of a
sharded layout (FSDP gathers layer by layer in every decode step, TP's collectives pair up) by batches of cfg.slots
completions decoded together (generate/decode.py)."""

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import torch
from torch import nn

from titan_lite.generate import Decoded, GenerationConfig, Lockstep, sample
from titan_lite.generate.engine import decode_slots
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
            if self.lockstep is None:
                return decode_slots(self.model, prompts, cfg, self.device, uniforms, on_step=on_step)
            return self.lockstep_sample(prompts, cfg, uniforms, on_step)

    def lockstep_sample(self, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, uniforms: torch.Tensor | None,
                        on_step: Callable[[float], None] | None) -> list[Decoded]:
        """Batches of cfg.slots completions (0: all), every rank's forwards paired; on_step: the share done."""
        size = cfg.slots or len(prompts)
        out: list[Decoded] = []
        for start in range(0, len(prompts), size):
            chunk = prompts[start:start + size]
            share = None if on_step is None else partial(_batch_share, on_step, start, len(chunk), len(prompts))
            out += sample(self.model, chunk, cfg, self.device, None if uniforms is None else
                          uniforms[start:start + size], self.lockstep, on_step=share)
        return out


def _batch_share(on_step: Callable[[float], None], start: int, size: int, total: int, share: float) -> None:
    on_step((start + size * share) / total)
