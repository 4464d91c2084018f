"""Answer accuracy on held-out math problems: batched greedy generation with the KV cache, and the final number of
each completion compared with the reference's."""

import logging
from dataclasses import dataclass

import torch
from torch import nn

from titan_lite.data.instruct import Example, prompt_text
from titan_lite.eval.answers import extract_answer, same_answer
from titan_lite.eval.generate import GenerationConfig, generate_text
from titan_lite.metrics.logger import Progress

logger = logging.getLogger(__name__)


@dataclass
class AnswerAccuracy:
    correct: int
    total: int
    prompts: list[str]
    completions: list[str]
    references: list[str]

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def sample_lines(self, count: int) -> list[str]:
        """The first `count` problems: prompt, completion, its extracted answer and the reference's."""
        lines = []
        for prompt, completion, reference in list(zip(self.prompts, self.completions, self.references,
                                                      strict=True))[:count]:
            verdict = "correct" if same_answer(completion, reference) else "wrong"
            lines.append(f"{prompt!r} -> {completion!r} (answer {extract_answer(completion)}, reference "
                         f"{extract_answer(reference)}: {verdict})")
        return lines


def answer_accuracy(model: nn.Module, tokenizer, problems: list[Example], template: str, max_new_tokens: int,
                    device: torch.device, batch_size: int) -> AnswerAccuracy:
    """Greedy completions of the templated prompts (stopping at eos), scored by their final number. Every rank
    that calls this generates the same problems (FSDP: each forward gathers the same weights on every rank)."""
    prompts = [prompt_text(template, p.prompt) for p in problems]
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    progress = Progress("answer accuracy: generating", len(prompts), f"completions of up to {max_new_tokens} tokens",
                        announce=True)
    completions = []
    for completion in generate_text(model, tokenizer, prompts, cfg, device, batch_size):
        completions.append(completion.text)
        progress.update(len(completions))
    references = [p.response for p in problems]
    correct = sum(same_answer(c, r) for c, r in zip(completions, references, strict=True))
    return AnswerAccuracy(correct, len(problems), prompts, completions, references)
