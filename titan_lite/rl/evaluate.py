"""Validation of RL on held-out prompts: each answered once, greedily, by the policy; the mean reward (the weighted sum
of the reward functions), each function's mean, answer_match's accuracy (when the rows hold the answer field) and the
mean completion length, over every data-parallel rank's share."""

import itertools
import logging
import math

from titan_lite.config.schema import JobConfig
from titan_lite.data.prompts import Prompt, build_prompt_source
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.rl.policy import Policy
from titan_lite.rl.rewards import AnswerMatch, Rewards, reward_arguments
from titan_lite.rl.rollout import data_parallel_gather, generation_config

logger = logging.getLogger(__name__)


class PromptValidation:
    """The held-out prompts (validation.steps batches of validation.local_batch_size per data-parallel rank, or all
    of them), split over the data-parallel ranks; every rank decodes the same number of batches (a short share is
    topped up with a repeated prompt whose answer is not counted)."""

    def __init__(self, cfg: JobConfig, tokenizer, policy: Policy, dims: ParallelDims):
        v = cfg.validation
        self.source = build_prompt_source(cfg, "validation", tokenizer, infinite=False)
        self.rewards = Rewards(cfg.grpo)
        self.answer = AnswerMatch(cfg.grpo.answer_field)
        pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else max(tokenizer.eos_id, 0)
        self.generation = generation_config(cfg, self.source.encoder.stop_ids(), pad_id, greedy=True)
        self.policy, self.decode = policy, tokenizer.decode
        batch_mesh = dims.submesh("batch")
        self.rank, self.ranks = batch_mesh.get_local_rank(), batch_mesh.size()
        self.gather = data_parallel_gather(dims)
        self.batch = v.local_batch_size
        self.limit = v.steps * v.local_batch_size * self.ranks if v.steps != -1 else None
        self.sample_outputs = v.sample_outputs

    def prompts(self) -> list[Prompt]:
        return [p for p, _ in itertools.islice(self.source.samples(), self.limit)]

    def evaluate(self, show_samples: bool = False) -> dict[str, float]:
        prompts = self.prompts()
        share = -(-len(prompts) // self.ranks)
        mine = list(range(self.rank, len(prompts), self.ranks))
        padded = mine + [mine[0] if mine else 0] * (share - len(mine))
        decoded = []
        for start in range(0, share, self.batch):
            ids = [list(prompts[i].ids) for i in padded[start:start + self.batch]]
            decoded += self.policy.sample(ids, self.generation)
        decoded = decoded[:len(mine)]
        texts = [self.decode(d.tokens[:-1] if d.stopped else d.tokens) for d in decoded]
        rows = [prompts[i].row for i in mine]
        scores = self.rewards.score(rows, texts, [d.tokens for d in decoded]) if mine else None
        correct = self.correct(rows, texts)
        records = [(i, scores[k].tolist(), correct[k], len(decoded[k].tokens), texts[k]) for k, i in enumerate(mine)]
        everyone = sorted((r for part in self.gather(records) for r in part), key=lambda r: r[0])
        if show_samples:
            for i, row_scores, _, _, text in everyone[:self.sample_outputs]:
                logger.info(f"  {prompts[i].text!r} -> {text!r} (rewards {row_scores})")
        return self.metrics(everyone)

    def correct(self, rows, texts) -> list[float]:
        """answer_match of each completion, NaN where the row has no answer field."""
        kwargs = reward_arguments(rows, texts, [[] for _ in texts])
        if not rows or any(self.answer.field not in row.fields for row in rows):
            return [math.nan] * len(rows)
        return self.answer(**kwargs)

    def metrics(self, records: list[tuple]) -> dict[str, float]:
        names = self.rewards.names
        totals = [self.rewards.total(self.rewards.weights.new_tensor([r[1]])).item() for r in records]
        out = {"reward": mean(totals)}
        out |= {f"rewards/{name}/mean": mean([r[1][k] for r in records]) for k, name in enumerate(names)}
        accuracy = mean([r[2] for r in records])
        if not math.isnan(accuracy):
            out["answer_accuracy"] = accuracy
        out["completions/mean_length"] = mean([r[3] for r in records])
        return out


def mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan
