"""The rollout source: prompts in, scored and packed training microbatches out, with the log-probabilities the policy
gave its tokens when it sampled them.

A step's rollout answers global_batch_size / G prompts (the next ones of the prompt stream, the same on every rank)
with G completions each: completion i answers prompt i // G. Completion i is sampled on the data-parallel rank that
trains it (the DataLoader's cut of a global batch: microbatch and rank by BatchLayout.keeps), from the uniform numbers
of row i of a [completions, max_completion_length] draw seeded by (seed, rollout count): the same samples whatever
the layout. Each rank scores its completions, then every rank gathers all of them (tokens, log-probabilities, rewards)
so the group advantages, the metrics and the rollout itself (checkpointed while passes remain, num_iterations > 1)
are the same on every rank. A microbatch holds its completions' prompt + completion sequences as block-causal
documents (document id = the completion's index), packed whole into windows of seq_len + 1 tokens, or one per row,
padded; with them a [rows, seq, 2] float tensor: every label's sampling log-probability and its completion's
advantage."""

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from titan_lite.config.schema import JobConfig
from titan_lite.data.batch import Batch
from titan_lite.data.dataloader import BatchLayout
from titan_lite.data.datasets import packed_sample
from titan_lite.data.instruct import PAD_DOCUMENT
from titan_lite.data.prompts import Prompt, PromptSource, build_prompt_source, check_prompt_fits
from titan_lite.errors import ConfigError
from titan_lite.generate import Decoded, GenerationConfig
from titan_lite.metrics.logger import Progress
from titan_lite.parallel.context_parallel import chunks_per_sequence
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.rl.advantages import ZeroSpreadWatch, group_advantages, reward_metrics
from titan_lite.rl.policy import Policy
from titan_lite.rl.rewards import Rewards

logger = logging.getLogger(__name__)
# gather(my records) -> every data-parallel rank's records (all_gather_object over the batch mesh, or [mine]).
Gather = Callable[[list], list]
VALUES = 2  # per token: the sampling log-probability of its label, its completion's advantage


def check_rollout_batch(cfg: JobConfig, global_batch: int, dims: ParallelDims) -> None:
    """A step's completions form whole groups of G."""
    g = cfg.grpo.num_generations
    if global_batch % g:
        raise ConfigError(f"a step's batch of {global_batch} completions ('training.local_batch_size' "
                          f"{cfg.training.local_batch_size} x data-parallel degree {dims.dp_degree} x accumulation) "
                          f"is not a multiple of 'grpo.num_generations' = {g}: each prompt is answered {g} times; set "
                          "training.global_batch_size to a multiple of it")


def generation_config(cfg: JobConfig, stop_ids: tuple[int, ...], pad_id: int, greedy: bool = False
                      ) -> GenerationConfig:
    """[grpo]'s sampling settings (greedy for validation); the end token is kept: it is trained like TRL's."""
    g = cfg.grpo
    return GenerationConfig(max_new_tokens=g.max_completion_length, temperature=0.0 if greedy else g.temperature,
                            top_k=g.top_k or None, top_p=g.top_p, stop_ids=stop_ids, pad_id=pad_id, keep_stop=True,
                            logprobs=g.logprobs, slots=g.generation_batch_size,
                            stop_check_interval=g.stop_check_interval, compile=g.compile_generation)


def length_multiple(cfg: JobConfig) -> int:
    """What a padded row's length must divide by: the TP degree (sequence parallel), times the CP chunks."""
    p = cfg.parallelism
    chunks = chunks_per_sequence(p.context_parallel_degree, p.context_parallel_load_balancer) \
        if p.context_parallel_degree > 1 else 1
    return chunks * p.tensor_parallel_degree


@dataclass(frozen=True)
class RolloutSettings:
    group: int
    generation: GenerationConfig
    scale_rewards: str
    iterations: int
    packing: bool
    seq_len: int
    multiple: int
    seed: int

    @classmethod
    def of(cls, cfg: JobConfig, stop_ids: tuple[int, ...], pad_id: int, seed: int) -> "RolloutSettings":
        g = cfg.grpo
        return cls(g.num_generations, generation_config(cfg, stop_ids, pad_id), g.scale_rewards, g.num_iterations,
                   g.packing, cfg.training.seq_len, length_multiple(cfg), seed)


@dataclass
class Rollout:
    """One step's completions of every rank, in global order: their prompts' ids, tokens (the end token last when
    one ended them), sampling log-probabilities and advantages; how many optimizer steps have used them."""

    prompt_ids: list[list[int]]
    completions: list[list[int]]
    logps: list[list[float]]
    advantages: list[float]
    passes: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"prompt_ids": self.prompt_ids, "completions": self.completions, "logps": self.logps,
                "advantages": self.advantages, "passes": self.passes, "metrics": self.metrics}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Rollout":
        return cls(state["prompt_ids"], state["completions"], state["logps"], state["advantages"], state["passes"],
                   dict(state["metrics"]))


@dataclass(frozen=True)
class Document:
    """One completion as a training document: prompt + completion tokens, which train, each token's sampling
    log-probability (0 on the prompt) and the completion's advantage and index."""

    tokens: list[int]
    trained: list[bool]
    logps: list[float]
    advantage: float
    index: int

    @classmethod
    def of(cls, rollout: Rollout, index: int, group: int) -> "Document":
        prompt, completion = rollout.prompt_ids[index // group], rollout.completions[index]
        return cls(prompt + completion, [False] * len(prompt) + [True] * len(completion),
                   [0.0] * len(prompt) + rollout.logps[index], rollout.advantages[index], index)


def document_rows(documents: list[Document], window: int, packing: bool) -> list[list[Document]]:
    """Documents in order into rows: packed whole while they fit a window of `window` tokens, or one per row."""
    if not packing:
        return [[d] for d in documents]
    rows: list[list[Document]] = []
    used = window
    for d in documents:
        if used + len(d.tokens) > window:
            rows.append([])
            used = 0
        rows[-1].append(d)
        used += len(d.tokens)
    return rows


def microbatch(documents: list[Document], window: int, packing: bool, pad_id: int, multiple: int = 1) -> Batch:
    """The Batch of a microbatch's documents (with their document ids, and values [rows, seq, 2]: each label's
    sampling log-probability and advantage): packed into windows of `window` tokens, or padded to the longest (its
    seq rounded up to a multiple of `multiple`)."""
    rows = document_rows(documents, window, packing)
    if not packing:
        window = -(-(max(len(d.tokens) for d in documents) - 1) // multiple) * multiple + 1
    samples = [packed_row(row, window, pad_id) for row in rows]
    inputs, labels, ids, values = (torch.stack(column) for column in zip(*samples, strict=True))
    return Batch(inputs, labels, ids, values=values)


def packed_row(row: list[Document], window: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    tokens, trained, ids, logps, advantages = [], [], [], [], []
    for d in row:
        tokens, trained, logps = tokens + d.tokens, trained + d.trained, logps + d.logps
        ids += [d.index] * len(d.tokens)
        advantages += [d.advantage] * len(d.tokens)
    pad = window - len(tokens)
    inputs, labels, documents = packed_sample(tokens + [pad_id] * pad, ids + [PAD_DOCUMENT] * pad,
                                              trained + [False] * pad)
    values = torch.tensor([logps + [0.0] * pad, advantages + [0.0] * pad], dtype=torch.float32).T[1:]
    return inputs, labels, documents, values


class RolloutSource:
    """Yields this rank's training microbatches, a new rollout every num_iterations steps; checkpointed like a data
    loader (its state is the same on every rank: the prompt stream's position, the count of rollouts, which seeds the
    sampling, and a rollout that more steps will use)."""

    name = "prompts"

    def __init__(self, settings: RolloutSettings, prompts: PromptSource, rewards: Rewards, policy: Policy,
                 layout: BatchLayout, gather: Gather, decode: Callable[[list[int]], str]):
        self.s = settings
        self.prompts = prompts
        self.rewards = rewards
        self.policy = policy
        self.layout = layout
        self.gather = gather
        self.decode = decode
        self.prompt_state: dict[str, Any] | None = None
        self.rollouts = 0
        self.current: Rollout | None = None
        self.members = self._members()
        self.spread = ZeroSpreadWatch()

    def _members(self) -> list[list[int]]:
        """This rank's completions of a step by microbatch, each in its place order (global indices)."""
        members: list[list[tuple[int, int]]] = [[] for _ in range(self.layout.accumulation)]
        for index in range(self.layout.global_batch):
            kept = self.layout.keeps(index)
            if kept is not None:
                members[kept[0]].append((kept[1], index))
        return [[index for _, index in sorted(m)] for m in members]

    # ------------------------------------------------------------------ the loader's interface

    def __iter__(self) -> Iterator[Batch]:
        stream = self.prompts.samples(self.prompt_state)
        while True:
            if self.current is None or self.current.passes >= self.s.iterations:
                self.current = self.roll_out(stream)
            batches = [self.microbatch(self.current, members) for members in self.members]
            self.current.passes += 1  # before the step's last microbatch is taken: the state after the step
            yield from batches

    def state_dict(self) -> dict[str, Any]:
        pending = self.current is not None and self.current.passes < self.s.iterations
        return {"prompts": self.prompt_state, "rollouts": self.rollouts, "global_batch": self.layout.global_batch,
                "rollout": self.current.state_dict() if pending else None, "dataset": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["global_batch"] != self.layout.global_batch:
            raise ConfigError(f"the checkpoint's rollouts have {state['global_batch']} completions per step, this run "
                              f"{self.layout.global_batch}; set 'training.global_batch_size' to "
                              f"{state['global_batch']} to continue the same run")
        self.prompts.seek(state["prompts"])  # a position of another order (rows, shuffle, seed) is one line now
        self.prompt_state, self.rollouts = state["prompts"], state["rollouts"]
        self.current = Rollout.from_state(state["rollout"]) if state["rollout"] is not None else None

    def metrics(self) -> dict[str, float]:
        """The current rollout's metrics (TRL's names), logged with the training line."""
        return dict(self.current.metrics) if self.current is not None else {}

    # ------------------------------------------------------------------ a rollout

    def roll_out(self, stream: Iterator[tuple[Prompt, dict[str, Any]]]) -> Rollout:
        g, global_batch = self.s.group, self.layout.global_batch
        picked = [next(stream) for _ in range(global_batch // g)]
        prompts = [p for p, _ in picked]
        self.prompt_state = picked[-1][1]
        for p in prompts:
            check_prompt_fits(p, self.s.generation.max_new_tokens, self.s.seq_len)
        seed = torch.Generator().manual_seed(self.s.seed * 1_000_003 + self.rollouts)
        uniforms = torch.rand(global_batch, self.s.generation.max_new_tokens, generator=seed)
        self.rollouts += 1
        mine = [i for members in self.members for i in members]
        start = time.perf_counter()
        decoded = self.sample([list(prompts[i // g].ids) for i in mine], uniforms[mine])
        seconds = time.perf_counter() - start
        texts = [self.decode(d.tokens[:-1] if d.stopped else d.tokens) for d in decoded]
        scores = self.rewards.score([prompts[i // g].row for i in mine], texts, [d.tokens for d in decoded])
        records = [(i, d.tokens, d.logps, d.stopped, s.tolist()) for i, d, s in zip(mine, decoded, scores,
                                                                                     strict=True)]
        everyone = sorted((r for part in self.gather(records) for r in part), key=lambda r: r[0])
        rollout = self.scored(prompts, everyone)
        generated = sum(len(d.tokens) for d in decoded)
        rollout.metrics |= {"rollout/generation_s": seconds, "rollout/tokens_per_s": generated / max(seconds, 1e-9)}
        return rollout

    def sample(self, prompt_ids: list[list[int]], uniforms: torch.Tensor) -> list[Decoded]:
        """This rank's completions (grpo.generation_batch_size decoded together), with progress lines for long
        rollouts."""
        progress = Progress("rollout: generating", len(prompt_ids), "completions on this rank")
        return self.policy.sample(prompt_ids, self.s.generation, uniforms,
                                  on_step=partial(batch_progress, progress, 0, len(prompt_ids)))

    def scored(self, prompts: list[Prompt], records: list[tuple]) -> Rollout:
        """The rollout of every rank's records (index, tokens, logps, stopped, scores): advantages and metrics."""
        scores = torch.tensor([r[4] for r in records], dtype=torch.float32)
        totals = self.rewards.total(scores)
        advantages, zero_std = group_advantages(totals, self.s.group, self.s.scale_rewards)
        lengths = torch.tensor([len(r[1]) for r in records], dtype=torch.float32)
        stopped = torch.tensor([r[3] for r in records])
        metrics = {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
                   "completions/max_length": lengths.max().item(),
                   "completions/clipped_ratio": (~stopped).float().mean().item()}
        metrics |= reward_metrics(scores, totals, self.rewards.names, zero_std)
        self.spread.update(metrics["frac_reward_zero_std"])
        return Rollout([list(p.ids) for p in prompts], [r[1] for r in records], [r[2] for r in records],
                       advantages.tolist(), metrics=metrics)

    def microbatch(self, rollout: Rollout, members: list[int]) -> Batch:
        documents = [Document.of(rollout, i, self.s.group) for i in members]
        return microbatch(documents, self.s.seq_len + 1, self.s.packing, self.s.generation.pad_id, self.s.multiple)


def batch_progress(progress: Progress, done: int, size: int, share: float) -> None:
    progress.update(done + size * share)


def one_rank(records: list) -> list:
    """gather() of a single data-parallel rank."""
    return [records]


# ------------------------------------------------------------------------------------------ from the config


def data_parallel_gather(dims: ParallelDims) -> Gather:
    """gather() over this rank's data-parallel peers (the batch mesh): every rank's records, in rank order."""
    if dims.dp_degree == 1:
        return one_rank
    group = dims.submesh("batch").get_group()

    def gather(records: list) -> list:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, records, group=group)
        return everyone
    return gather


def build_rollout_source(cfg: JobConfig, tokenizer, layout: BatchLayout, policy: Policy, dims: ParallelDims,
                         seed: int) -> RolloutSource:
    """The training rollouts of [grpo] over training.dataset_path's prompts."""
    prompts = build_prompt_source(cfg, "training", tokenizer, infinite=True)
    pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else max(tokenizer.eos_id, 0)
    settings = RolloutSettings.of(cfg, prompts.encoder.stop_ids(), pad_id, seed)
    if dims.world_size > 1 and cfg.grpo.compile_generation:  # FSDP2's hooks are marked for dynamo to skip
        settings = replace(settings, generation=replace(settings.generation, compile=False))
        logger.warning("grpo.compile_generation: on a sharded layout the decode engine's step runs eagerly "
                       "(torch.compile cannot capture the sharded forward whole: FSDP's hooks, DTensor's collectives)")
    return RolloutSource(settings, prompts, Rewards(cfg.grpo), policy, layout, data_parallel_gather(dims),
                         tokenizer.decode)
