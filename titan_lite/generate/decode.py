"""Batched decoding with a KV cache: prefill the prompts, then one token per step (greedy, or sampled at a
temperature among the top k / top p), stopping at an end token. The cache lives in generate/cache.py; the model
reads it only when one is passed to its forward (training never does).

Prompts of different lengths are left-padded: each row's tokens keep positions 0.. of their own, padding is masked
out of every key, and all rows end on the same slot, so one next-token step serves the whole batch.

On a sharded model (FSDP gathers layer by layer in every forward; TP's collectives) every rank that shares a forward
must run the same number of forwards on sequences split the same way: a `Lockstep` makes the ranks decode until all
of them are done, and pads each forward to a multiple of the sequence-parallel degree with slots that hold no token.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from titan_lite.dtensor import full_tensor
from titan_lite.generate.cache import KVCache
from titan_lite.generate.sampling import Sampling, choose_with, chosen_logps


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int | None = None  # sample among the k most likely tokens (with temperature > 0)
    top_p: float = 1.0  # sample among the most likely tokens holding this much probability (with temperature > 0)
    stop_ids: tuple[int, ...] = ()  # end tokens: a row stops after producing one
    pad_id: int = 0
    seed: int = 0  # of the uniform numbers the samples are drawn with, unless they are given
    keep_stop: bool = False  # the stop token ends the row's tokens (RL trains on it); else it is not returned
    logprobs: str = "full"  # the returned log-probabilities' distribution: full tempered, or "sampled" (truncated)
    # the decode engine's (generate/engine.py; `sample` decodes `slots` rows at a time where it is not used)
    slots: int = 0  # rows decoded together (0: all of the prompts)
    stop_check_interval: int = 8  # decode steps between the host's reads of which completions ended
    compile: bool = False  # torch.compile the decode step (CUDA graphs on CUDA)
    prefill_batch: int = 0  # prompts prefilled together at most (0: as many as the free slots reach)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.logprobs)


@dataclass
class Lockstep:
    """Ranks whose forwards pair up (FSDP's gathers, TP's collectives): each decodes until every one is done, and each
    forward's length is a multiple of `multiple` (the sequence-parallel degree). `group` None: the whole world."""

    group: dist.ProcessGroup | None = None
    multiple: int = 1

    def all_done(self, done: torch.Tensor) -> bool:
        busy = (~done).any().to(torch.int32)[None]
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.group)
        return not bool(busy.item())


@dataclass
class Decoded:
    """A row's new tokens, the log-probability of each under the sampling distribution (see sampling.chosen_logps),
    and whether it ended at a stop token (else at max_new_tokens or stop_when)."""

    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    stopped: bool = False


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device,
                multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, real) [batch, longest rounded up to `multiple`]: each prompt right-aligned after padding."""
    longest = -(-max(len(p) for p in prompts) // multiple) * multiple
    tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    real = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        if prompt:
            tokens[i, longest - len(prompt):] = torch.tensor(list(prompt))
            real[i, longest - len(prompt):] = True
    return tokens.to(device), real.to(device)


def prompts_of(tokens: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The prompts of a padded batch (left or right padding, or any mask): each row's tokens where the mask is set."""
    return [row[mask.bool()].tolist() for row, mask in zip(tokens.cpu(), attention_mask.cpu(), strict=True)]


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, device: torch.device,
             stop_when: Callable[[list[int]], bool] | None = None,
             on_step: Callable[[float], None] | None = None) -> list[list[int]]:
    """Continue each prompt (token ids) with up to max_new_tokens tokens; a row stops at a stop id (not
    included unless cfg.keep_stop), or once `stop_when(its new tokens)` holds (those tokens kept: e.g. a stop string
    in their text). `on_step(fraction)`: after every decode step, the share of max_new_tokens done. The model runs in
    eval mode (no dropout) and is put back in its previous mode."""
    return [row.tokens for row in sample(model, prompts, cfg, device, stop_when=stop_when, on_step=on_step)]


@torch.no_grad()
def sample(model: nn.Module, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, device: torch.device,
           uniforms: torch.Tensor | None = None, lockstep: Lockstep | None = None,
           stop_when: Callable[[list[int]], bool] | None = None,
           on_step: Callable[[float], None] | None = None) -> list[Decoded]:
    """generate's rows with their log-probabilities. `uniforms` [batch, max_new_tokens] in [0, 1): the number each
    row's sample at each step is drawn with (default: drawn from cfg.seed); `lockstep`: for a sharded model."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if uniforms is None and not cfg.sampling.greedy:
        uniforms = torch.rand(len(prompts), cfg.max_new_tokens, generator=torch.Generator().manual_seed(cfg.seed))
    was_training = model.training
    model.eval()
    try:
        # compiled blocks run eagerly here: each decode step's shapes would recompile them (a full graph's limit)
        with torch.compiler.set_stance("force_eager"):
            return _decode(model, prompts, cfg, device, uniforms, lockstep, stop_when, on_step)
    finally:
        model.train(was_training)


def _decode(model: nn.Module, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, device: torch.device,
            uniforms: torch.Tensor | None, lockstep: Lockstep | None,
            stop_when: Callable[[list[int]], bool] | None,
            on_step: Callable[[float], None] | None) -> list[Decoded]:
    m = lockstep.multiple if lockstep is not None else 1
    tokens, real = left_padded(prompts, cfg.pad_id, device, m)
    batch = tokens.shape[0]
    cache = KVCache(model.args, batch, tokens.shape[1] + cfg.max_new_tokens * m, device, last_only=m == 1)
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(tokens, cache=cache.step(real, positions))
    lengths = real.sum(dim=1)
    stop = torch.tensor(cfg.stop_ids or [-1], device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    out = [Decoded() for _ in range(batch)]
    # the slots of a step: m - 1 empty ones, then the row's token (the last slot's logits are the next token's)
    lead = torch.zeros(batch, m - 1, dtype=torch.long, device=device)
    for step in range(cfg.max_new_tokens):
        last = full_tensor(logits)[:, -1]
        chosen, probs = choose_with(last, cfg.sampling, None if uniforms is None else uniforms[:, step])
        logps = chosen_logps(last, chosen, cfg.sampling, probs).tolist()
        finished = torch.isin(chosen, stop)
        keep = ~done & (~finished | cfg.keep_stop)
        for i in keep.nonzero().flatten().tolist():
            out[i].tokens.append(int(chosen[i]))
            out[i].logps.append(logps[i])
        for i in (~done & finished).nonzero().flatten().tolist():
            out[i].stopped = True
        if stop_when is not None:
            for i in (~done & ~finished).nonzero().flatten().tolist():
                if stop_when(out[i].tokens):
                    finished[i] = True
        done |= finished
        if on_step is not None:
            on_step((step + 1) / cfg.max_new_tokens)
        if step == cfg.max_new_tokens - 1 or (lockstep.all_done(done) if lockstep is not None else bool(done.all())):
            break
        chosen = torch.where(done, torch.full_like(chosen, cfg.pad_id), chosen)
        step_tokens = torch.cat([lead + cfg.pad_id, chosen[:, None]], dim=1)
        step_real = torch.cat([lead.bool(), ~done[:, None]], dim=1)
        step_positions = torch.cat([lead, (lengths + step)[:, None]], dim=1)
        logits = model(step_tokens, cache=cache.step(step_real, step_positions))
    return out
