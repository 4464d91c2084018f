"""Generation for text prompts: tokenized (or given as ids), generated in batches, decoded back to text."""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import nn

from titan_lite.generate.decode import GenerationConfig, generate


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
