"""Batched text generation with a KV cache: prefill the prompts, then decode one token per step (greedy, or
temperature / top-k sampling), stopping at an end token. The cache lives here; the model reads it only when one is
passed to its forward (training never does).

Prompts of different lengths are left-padded: each row's tokens keep positions 0.. of their own, padding is masked
out of every key, and all rows end on the same slot, so one next-token step serves the whole batch.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import nn

from titan_lite.models.llama import LlamaArgs
from titan_lite.models.llama.model import apply_rope, grouped_attention, rope_cache, within_window


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int | None = None  # sample among the k most likely tokens (with temperature > 0)
    stop_ids: tuple[int, ...] = ()  # end tokens: a row stops after producing one (it is not returned)
    pad_id: int = 0
    seed: int = 0


class KVCache:
    """Keys and values of every layer for a batch, in slots 0..capacity-1, with which slots hold real tokens.

    `step(tokens_real, positions)` opens the next slots for a forward: it records their rotary rows and the
    attention mask (each new query sees the real keys up to its own slot, and itself; with a sliding window only
    those within the window of its position) that every layer then uses.
    """

    def __init__(self, args: LlamaArgs, batch: int, capacity: int, device: torch.device):
        self.rope = rope_cache(replace(args, max_seq_len=capacity), device)
        self.capacity = capacity
        self.window = args.sliding_window
        self.real = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.start = self.end = 0
        self.rows = self.mask = None

    def step(self, real: torch.Tensor, positions: torch.Tensor) -> "KVCache":
        """Open slots for a [batch, seq] forward: `real` marks real tokens, `positions` their rotary positions."""
        seq = real.shape[1]
        self.start, self.end = self.end, self.end + seq
        if self.end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} slots is full")
        self.real[:, self.start:self.end] = real
        self.positions[:, self.start:self.end] = positions
        self.rows = self.rope[positions]
        slots = torch.arange(self.end, device=real.device)
        queries = slots[self.start:, None]
        visible = self.real[:, None, :self.end] & (slots[None, :] <= queries)[None]
        if self.window is not None:
            visible &= within_window(positions, self.positions[:, :self.end], self.window)
        self.mask = (visible | (slots[None, :] == queries)[None])[:, None]  # [batch, 1, seq, end]
        return self

    def layer(self, layer_id: int) -> "LayerView":
        return LayerView(self, layer_id)


@dataclass
class LayerView:
    """One layer's access to the cache (the model's LayerCache protocol)."""

    cache: KVCache
    layer_id: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.cache
        q, k = apply_rope(q, c.rows).transpose(1, 2), apply_rope(k, c.rows).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.layer_id not in c.keys:
            shape = (k.shape[0], k.shape[1], c.capacity, k.shape[3])
            c.keys[self.layer_id] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            c.values[self.layer_id] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        keys, values = c.keys[self.layer_id], c.values[self.layer_id]
        keys[:, :, c.start:c.end], values[:, :, c.start:c.end] = k, v
        return grouped_attention(q, keys[:, :, :c.end], values[:, :, :c.end], attn_mask=c.mask)


def next_tokens(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None) -> torch.Tensor:
    """[batch, vocab] -> [batch]: argmax, or a sample at the temperature among the top k."""
    if cfg.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k is not None:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, real) [batch, longest]: each prompt right-aligned after padding."""
    longest = max(len(p) for p in prompts)
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
    included), or once `stop_when(its new tokens)` holds (those tokens kept: e.g. a stop string in their text).
    `on_step(fraction)`: after every decode step, the share of max_new_tokens done. The model runs in eval mode (no
    dropout) and is put back in its previous mode."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    was_training = model.training
    model.eval()
    try:
        return _decode(model, prompts, cfg, device, stop_when, on_step)
    finally:
        model.train(was_training)


def _decode(model: nn.Module, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, device: torch.device,
            stop_when: Callable[[list[int]], bool] | None,
            on_step: Callable[[float], None] | None = None) -> list[list[int]]:
    tokens, real = left_padded(prompts, cfg.pad_id, device)
    batch = tokens.shape[0]
    cache = KVCache(model.args, batch, tokens.shape[1] + cfg.max_new_tokens, device)
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(tokens, cache=cache.step(real, positions))
    lengths = real.sum(dim=1)
    generator = torch.Generator(device=device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
    stop = torch.tensor(cfg.stop_ids or [-1], device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in range(batch)]
    for step in range(cfg.max_new_tokens):
        chosen = next_tokens(logits[:, -1], cfg, generator)
        finished = torch.isin(chosen, stop)
        for i in (~done & ~finished).nonzero().flatten().tolist():
            out[i].append(int(chosen[i]))
            if stop_when is not None and stop_when(out[i]):
                finished[i] = True
        done |= finished
        if on_step is not None:
            on_step((step + 1) / cfg.max_new_tokens)
        if bool(done.all()) or step == cfg.max_new_tokens - 1:
            break
        chosen = torch.where(done, torch.full_like(chosen, cfg.pad_id), chosen)
        logits = model(chosen[:, None], cache=cache.step(~done[:, None], (lengths + step)[:, None]))
    return out


@dataclass
class Completion:
    prompt: str
    text: str
    tokens: list[int] = field(default_factory=list)


def generate_text(model: nn.Module, tokenizer, prompts: Sequence[str], cfg: GenerationConfig,
                  device: torch.device, batch_size: int = 8,
                  prompt_ids: Sequence[Sequence[int]] | None = None) -> list[Completion]:
    """Generate for text prompts (tokenized with bos, or given as `prompt_ids`, e.g. a chat template's rendering),
    `batch_size` prompts at a time; stops at the tokenizer's eos unless cfg.stop_ids says otherwise."""
    return list(iter_completions(model, tokenizer, prompts, cfg, device, batch_size, prompt_ids))


def iter_completions(model: nn.Module, tokenizer, prompts: Sequence[str], cfg: GenerationConfig,
                     device: torch.device, batch_size: int = 8, prompt_ids: Sequence[Sequence[int]] | None = None,
                     on_progress: Callable[[float], None] | None = None) -> Iterator[Completion]:
    """generate_text's completions as each batch finishes; `on_progress(done)` after every decode step: the
    completions done so far, the running batch counted by its share of max_new_tokens (what a progress line with an
    ETA needs while a batch of long completions decodes)."""
    if not cfg.stop_ids and tokenizer.eos_id >= 0:
        cfg = replace(cfg, stop_ids=(tokenizer.eos_id,))
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        ids = [tokenizer.encode(p, bos=True, eos=False) for p in chunk] if prompt_ids is None else \
            [list(i) for i in prompt_ids[start:start + batch_size]]
        on_step = None if on_progress is None else partial(_batch_share, on_progress, start, len(chunk))
        for prompt, new in zip(chunk, generate(model, ids, cfg, device, on_step=on_step), strict=True):
            yield Completion(prompt, tokenizer.decode(new), new)
        if on_progress is not None:
            on_progress(start + len(chunk))


def _batch_share(on_progress: Callable[[float], None], start: int, size: int, share: float) -> None:
    on_progress(start + size * share)
