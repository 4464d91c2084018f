"""GRPO as the training objective ([grpo], training.dataset = "prompts"), with TRL's loss types: on a microbatch of
rollouts (rl/rollout.py: prompt + completion documents, each label's sampling log-probability and its completion's
advantage) the policy's log-probabilities at the sampling temperature (chunked, float32, vocab-sharded under TP:
objective/logps.py; with logprobs "sampled", of the truncated distribution the rollout drew from) give the clipped
importance-weighted advantage of every completion token, plus beta x the k3 KL to the reference (the policy with its
adapters off, or a frozen model: objective/frozen.py, as preference tuning's).
The token losses are summed; the trainer divides by the step's global units: completion tokens (dapo), completions
(grpo, each completion's tokens weighted by 1 / its length first) or completions x max_completion_length (dr_grpo),
so accumulation and data parallelism equal one bigger batch. TRL's metrics (kl, entropy, clip ratios) are global
token means. DRY_RUN's share is in grpo_plan.py."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.data.batch import Batch
from titan_lite.generate import Sampling, kept_tokens
from titan_lite.job.assembly import BuiltModel
from titan_lite.job.plan import JobPlan
from titan_lite.loss import IGNORE_INDEX
from titan_lite.objective.base import Objective
from titan_lite.objective.frozen import FrozenSpec, check_base_reference
from titan_lite.objective.logps import tempered_logps
from titan_lite.objective.reference import BASE, Reference

logger = logging.getLogger("titan_lite")
# The sums behind the logged metrics, per completion token, in this order.
TOKEN_SUMS = ("tokens", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class GRPOLoss:
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    temperature: float = 1.0
    max_completion_length: int = 512
    kl_ratio: bool = True  # the KL weighted by the importance ratio (use_bias_correction_kl)
    sampled: Sampling | None = None  # logprobs "sampled": the policy's truncated distribution (the rollout's)

    def describe(self) -> str:
        clip = f"clip [1 - {self.epsilon:g}, 1 + {self.epsilon_high:g}]"
        kl = f", beta {self.beta:g} x k3 KL" if self.beta else " (no KL term)"
        where = " (top k / top p, renormalised)" if self.sampled is not None else ""
        return f"loss {self.loss_type}, {clip}{kl}, temperature {self.temperature:g}{where}"

    def keep(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The policy's tokens in its distribution (logps.Keep), or None: all of them."""
        return None if self.sampled is None else lambda block: kept_tokens(block, self.sampled)


def loss_spec(cfg: JobConfig) -> GRPOLoss:
    g = cfg.grpo
    sampling = Sampling(g.temperature, g.top_k or None, g.top_p, g.logprobs)
    return GRPOLoss(g.loss_type, g.epsilon, g.epsilon if g.epsilon_high is None else g.epsilon_high, g.beta,
                    g.temperature, g.max_completion_length, g.use_bias_correction_kl,
                    sampling if sampling.sampled else None)


def reference_spec(cfg: JobConfig) -> FrozenSpec:
    g = cfg.grpo
    return FrozenSpec(g.reference, g.reference_flavor, g.reference_config, "reference", "grpo.reference",
                      "grpo.reference_flavor", "grpo.reference_config", "policy",
                      "the KL term compares their log-probabilities of the same token ids")


def reference_of(cfg: JobConfig) -> Reference:
    """None (beta 0: no reference), 'base' (the policy with its adapters off) or 'path' (a frozen model)."""
    return Reference.of(reference_spec(cfg), used=cfg.grpo.beta != 0)



# ------------------------------------------------------------------------------------------ a microbatch


@dataclass
class CompletionBatch:
    """What the loss reads of a microbatch on this rank: labels, each label's sampling log-probability and
    advantage, and each token's weight in the sum (1, or 1 / its completion's length for loss_type grpo)."""

    labels: torch.Tensor
    old_logps: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor


def completion_units(labels: torch.Tensor, documents: torch.Tensor, spec: GRPOLoss) -> torch.Tensor:
    """[what the loss is divided by, completions, completion tokens] of a microbatch (float64)."""
    valid = labels != IGNORE_INDEX
    tokens = valid.sum().double()
    completions = torch.tensor(float(documents[valid].unique().numel()), dtype=torch.float64, device=labels.device)
    norm = {"dapo": tokens, "grpo": completions, "dr_grpo": completions * spec.max_completion_length}[spec.loss_type]
    return torch.stack([norm, completions, tokens])


def completion_weights(labels: torch.Tensor, documents: torch.Tensor, loss_type: str) -> torch.Tensor:
    """Each token's weight: 1 / its completion's count of completion tokens (grpo), else 1; 0 off completions."""
    valid = labels != IGNORE_INDEX
    if loss_type != "grpo":
        return valid.float()
    ids = documents.clamp(min=0)
    counts = torch.zeros(int(ids.max()) + 1, dtype=torch.float32, device=labels.device)
    counts.index_add_(0, ids[valid], torch.ones(int(valid.sum()), device=labels.device))
    return torch.where(valid, 1.0 / counts[ids].clamp(min=1.0), 0.0)


def token_terms(logps: torch.Tensor, batch: CompletionBatch, reference: torch.Tensor | None,
                spec: GRPOLoss) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token k3 KL or None, low-clipped, high-clipped) of TRL's GRPO loss, token-level
    importance sampling: -min(r A, clip(r, 1 - eps, 1 + eps_high) A) + beta KL, r = exp(log pi - log pi_old), the KL
    k3 = exp(ref - log pi) - (ref - log pi) - 1, times r with kl_ratio (TRL's use_bias_correction_kl)."""
    ratio = torch.exp(logps - batch.old_logps)
    clipped = torch.clamp(ratio, 1 - spec.epsilon, 1 + spec.epsilon_high)
    a = batch.advantages
    per_token = -torch.min(ratio * a, clipped * a)
    kl = None
    if spec.beta:
        delta = reference - logps
        kl = torch.exp(delta) - delta - 1
        if spec.kl_ratio:
            kl = kl * ratio
        per_token = per_token + spec.beta * kl
    low = (ratio < 1 - spec.epsilon) & (a < 0)
    high = (ratio > 1 + spec.epsilon_high) & (a > 0)
    return per_token, kl, low, high


class GRPOObjective(Objective):
    """The microbatch's token losses, weighted and summed (the trainer divides by the step's global units); the
    reference, when there is one (beta > 0), runs first under no_grad through the runner's forward on the same inputs,
    and only its per-token log-probabilities are kept."""

    def __init__(self, loss_fn: Callable, spec: GRPOLoss, reference: Callable | None):
        super().__init__(loss_fn)
        self.spec = spec
        self.frozen = reference  # (forward) -> the reference's logits, or None
        self.sums: torch.Tensor | None = None

    def units(self, batch: Batch) -> torch.Tensor:
        return completion_units(batch.labels, batch.documents, self.spec)

    def prepare(self, batch: Batch, shard: Callable) -> CompletionBatch:
        values = batch.values
        if values is None:
            raise RuntimeError("GRPO trains on rollouts: a microbatch without sampling log-probabilities and "
                               "advantages")
        weights = completion_weights(batch.labels, batch.documents, self.spec.loss_type)
        return CompletionBatch(*shard(batch.labels, values[..., 0], values[..., 1], weights))

    @torch.no_grad()
    def reference(self, forward: Callable[[nn.Module], torch.Tensor],
                  prepared: CompletionBatch = None) -> torch.Tensor | None:
        """The reference's per-token log-probabilities at the temperature (None without a KL term): of its full
        tempered distribution, also with logprobs "sampled" (k3 then estimates KL(truncated policy || reference) from
        the policy's own samples; truncated by its own top p the reference could give a sampled token -inf)."""
        if not self.spec.beta:
            return None
        logits = self.frozen(forward)
        logps, _ = tempered_logps(logits, prepared.labels, self.spec.temperature)
        return logps

    def loss_and_sums(self, logits: torch.Tensor, batch: CompletionBatch,
                      reference: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the microbatch's weighted sum of token losses, its TOKEN_SUMS)."""
        logps, entropy = tempered_logps(logits, batch.labels, self.spec.temperature, entropy=True,
                                        keep=self.spec.keep())
        per_token, kl, low, high = token_terms(logps, batch, reference, self.spec)
        valid = (batch.labels != IGNORE_INDEX).double()
        loss = (per_token * batch.weights).sum()
        kl_sum = (kl.detach().double() * valid).sum() if kl is not None else valid.new_zeros(())
        sums = torch.stack([valid.sum(), kl_sum, (entropy.double() * valid).sum(), (low * valid).sum(),
                            (high * valid).sum(), ((low | high) * valid).sum()])
        return loss, sums

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor, reference: Any = None,
                 prepared: CompletionBatch = None) -> torch.Tensor:
        loss, sums = self.loss_and_sums(logits, prepared, reference)
        self.sums = sums if self.sums is None else self.sums + sums
        return loss

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """TRL's global token means from the global TOKEN_SUMS (kl only with a KL term)."""
        s = dict(zip(TOKEN_SUMS, sums.tolist(), strict=True))
        tokens = max(s.pop("tokens"), 1.0)
        kl = s.pop("kl")
        return ({"kl": kl / tokens} if self.spec.beta else {}) | {name: value / tokens for name, value in s.items()}

    def step_metrics(self, global_sum: Callable[[torch.Tensor], torch.Tensor],
                     global_units: torch.Tensor) -> dict[str, float]:
        sums, self.sums = self.sums, None
        if sums is None:
            sums = torch.zeros(len(TOKEN_SUMS), dtype=torch.float64, device=global_units.device)
        return self.metrics(global_sum(sums))

    def pipeline_step(self, pipeline, inputs, labels, batch, scale, extra) -> torch.Tensor:
        raise RuntimeError("GRPO does not run under pipeline parallelism (the config check refuses it)")


# ------------------------------------------------------------------------------------------ checks and building


def check_grpo(plan: JobPlan) -> None:
    """Before launch: a KL reference that can serve ('base': adapters that keep the base apart; a folder: usable)."""
    reference_of(plan.cfg).check(plan, check_base)


def check_base(plan: JobPlan) -> None:
    check_base_reference(plan, "grpo.reference", trains_in_full_fix="name a reference folder (the model training "
                                                                      "starts from) in 'grpo.reference'")


def grpo_reference_problem(cfg: JobConfig) -> str | None:
    """DRY_RUN's checklist line for a reference folder not downloaded yet, or None."""
    return reference_of(cfg).files_problem(cfg)


def build_grpo(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> GRPOObjective:
    """The objective with its reference: none (beta 0), the policy's base, or a frozen model assembled here."""
    cfg, spec = plan.cfg, loss_spec(plan.cfg)
    reference = reference_of(cfg)
    frozen = reference.load(plan, model, device, seed)
    if reference.kind == BASE:
        where = "the reference is the policy's own base, its adapters switched off (no second copy)"
    elif frozen is not None:
        where = frozen.describe(reference.spec)
    else:
        where = "no reference model"
    logger.info(f"grpo: {spec.describe()}; {where}")
    return GRPOObjective(model.runner.loss_fn, spec, frozen)
