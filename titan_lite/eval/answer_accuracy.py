"""Answer accuracy on held-out math problems: batched greedy generation with the KV cache, and the final number of
each completion compared with the reference's."""

import logging
from dataclasses import dataclass

import torch
from torch import nn

from titan_lite.data.instruct import InstructFormat, Record
from titan_lite.generate import GenerationConfig, iter_completions
from titan_lite.metrics.logger import Progress
from titan_lite.rl.answers import extract_answer, same_answer

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


def answer_accuracy(model: nn.Module, fmt: InstructFormat, problems: list[Record], max_new_tokens: int,
                    device: torch.device, batch_size: int) -> AnswerAccuracy:
    """Greedy completions of the problems' prompts as the run's format makes them (the prompt template, or the
    conversation up to its last assistant turn in the chat template), stopping at eos or the template's end-of-turn
    token, scored by their final number against the reference (the response, or the last assistant turn). Every
    rank that calls this generates the same problems (FSDP: each forward gathers the same weights on every rank)."""
    prompts, ids, references = zip(*(fmt.problem(p) for p in problems), strict=True) if problems else ((), (), ())
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=fmt.stop_ids())
    progress = Progress("answer accuracy: generating", len(prompts), f"completions of up to {max_new_tokens} tokens",
                        announce=True)
    completions = [c.text for c in iter_completions(model, fmt.tokenizer, list(prompts), cfg, device, batch_size,
                                                    prompt_ids=list(ids), on_progress=progress.update)]
    correct = sum(same_answer(c, r) for c, r in zip(completions, references, strict=True))
    return AnswerAccuracy(correct, len(problems), list(prompts), completions, list(references))
