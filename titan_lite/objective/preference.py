"""Preference tuning as the training objective ([preference]): pairs packed as documents (data/preference.py) give
every answer's log-probability (summed over its tokens, chunked: objective/logps.py); the pair losses of
preference_loss.py compare them with the reference's: the policy with its adapters off ('base'), a frozen model on
the policy's mesh (objective/frozen.py), or a table computed before training (reference_pass.py) and checkpointed
with the run. TRL's metrics (rewards/*, logps/*, logits/*) are logged for training and for the held-out pairs; under
pipeline parallelism the last stage computes the loss. DRY_RUN's share is in preference_plan.py."""

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.data.batch import Batch
from titan_lite.data.preference import CHOSEN
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import BuiltModel
from titan_lite.job.plan import JobPlan
from titan_lite.loss import IGNORE_INDEX
from titan_lite.objective.base import Objective
from titan_lite.objective.frozen import FrozenForward, FrozenSpec, check_base_reference
from titan_lite.objective.logps import token_logps
from titan_lite.objective.preference_loss import PreferenceLoss, pair_terms
from titan_lite.objective.reference import BASE, Reference

logger = logging.getLogger("titan_lite")
# The sums behind the logged metrics, in this order: per pair (the same on every context-parallel rank) ...
PAIR_SUMS = ("pairs", "pair_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
             "logps/rejected")
# ... and per token (each context-parallel rank's own tokens).
TOKEN_SUMS = ("nll", "logits/chosen", "logits/rejected", "tokens/chosen", "tokens/rejected")


def loss_spec(cfg: JobConfig) -> PreferenceLoss:
    p = cfg.preference
    return PreferenceLoss(p.loss, p.beta, p.label_smoothing, p.robust, p.simpo_gamma, p.sft_weight)


def reference_spec(cfg: JobConfig) -> FrozenSpec:
    p = cfg.preference
    return FrozenSpec(p.reference, p.reference_flavor, p.reference_config, "reference", "preference.reference",
                      "preference.reference_flavor", "preference.reference_config", "policy",
                      "preference tuning compares their log-probabilities of the same token ids")


def reference_of(cfg: JobConfig) -> Reference:
    """None (a reference-free loss), 'base' (the policy with its adapters off) or 'path' (a frozen model)."""
    return Reference.of(reference_spec(cfg), used=not loss_spec(cfg).reference_free)



# ------------------------------------------------------------------------------------------ a microbatch's pairs


@dataclass
class PairBatch:
    """A microbatch's pairs as the loss reads them: every local token's answer (0 .. 2 x pairs - 1, chosen then
    rejected of each pair; 2 x pairs for tokens of no answer), this rank's labels, each pair's row in its file and
    the token counts of its answers (of the whole sequence, not this context-parallel rank's part)."""

    answer: torch.Tensor  # [local tokens]
    labels: torch.Tensor  # [batch, local seq]
    examples: torch.Tensor  # [pairs]
    lengths: torch.Tensor  # [pairs, 2] float64

    @property
    def pairs(self) -> int:
        return self.examples.numel()


def pair_batch(labels: torch.Tensor, documents: torch.Tensor, shard: Callable) -> PairBatch:
    """A PairBatch of whole [batch, seq] labels and document ids (answer_document's: 2 x row + answer, -1 for
    padding): every run of one document id is an answer, and each pair's chosen run is followed by its rejected."""
    flat = documents.flatten()
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    starts = starts.flatten() & (flat >= 0)
    answers = int(starts.sum())
    answer = torch.where(flat >= 0, starts.cumsum(0) - 1, answers)
    ids = flat[starts]
    if answers % 2 or not torch.equal(ids[1::2], ids[0::2] + 1) or (ids[0::2] % 2).any():
        raise RuntimeError(f"a microbatch's answers are not whole pairs (chosen then rejected): {ids.tolist()}")
    counts = torch.zeros(answers + 1, dtype=torch.float64, device=labels.device)
    counts.index_add_(0, answer, (labels.flatten() != IGNORE_INDEX).double())
    local_labels, local_answer = shard(labels, answer.view(documents.shape))
    return PairBatch(local_answer.flatten(), local_labels, ids[0::2] // 2, counts[:answers].view(-1, 2))


def pair_units(labels: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """[pairs, chosen answers' trained tokens] of a microbatch (float64)."""
    chosen = (documents >= 0) & (documents % 2 == CHOSEN)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.stack([(starts & chosen).sum(), (chosen & (labels != IGNORE_INDEX)).sum()]).double()


def answer_sums(values: torch.Tensor, batch: PairBatch) -> torch.Tensor:
    """[pairs, 2] sums of per-token values [batch, local seq] over each answer's tokens on this rank (float64)."""
    sums = torch.zeros(2 * batch.pairs + 1, dtype=torch.float64, device=values.device)
    return sums.index_add(0, batch.answer, values.flatten().double())[:-1].view(-1, 2)


class ContextParallelSum:
    """Sums of an answer's tokens split over context-parallel ranks: all-reduced whole, with the gradient of each
    rank's own part (the ranks' parameter gradients add up to the whole gradient, as the token losses' do)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int):
        self.group, self.size = group, size

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return local
        total = local.detach().clone()
        dist.all_reduce(total, group=self.group)
        return local + (total - local.detach())

    def once(self, value: torch.Tensor) -> torch.Tensor:
        """A value every context-parallel rank computes alike, counted once when the ranks' values are summed (its
        gradient whole on each rank)."""
        return value if self.group is None else value - value.detach() + value.detach() / self.size


def _target_batch(target: torch.Tensor) -> PairBatch:
    """The PairBatch of a pipeline microbatch's target: labels and document ids side by side."""
    labels, documents = target.chunk(2, dim=1)
    return pair_batch(labels, documents, lambda *tensors: tensors)


@dataclass
class StepReference:
    """A step's reference log-probabilities [pairs, 2] by row, from a forward-only pipeline pass."""

    examples: torch.Tensor
    values: torch.Tensor

    def lookup(self, examples: torch.Tensor) -> torch.Tensor:
        at = (self.examples.to(examples.device)[None, :] == examples[:, None]).double().argmax(dim=1)
        return self.values.to(examples.device)[at]


# ------------------------------------------------------------------------------------------ the reference table


class ReferenceTable:
    """The reference's [chosen, rejected] log-probabilities of every pair of a file (by row; NaN for rows no split
    uses), per section, with a fingerprint of what they were computed from. Checkpointed like the data position (the
    same on every rank): a resumed run loads them and never recomputes them."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.tables: dict[str, torch.Tensor] = {}
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "tables": {k: v.cpu() for k, v in self.tables.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != self.fingerprint:
            raise ConfigError("the checkpoint's precomputed reference log-probabilities were made from other data or "
                              "settings (the data file, seq_len, [preference] truncation, chat template or reference "
                              "changed): resuming would mix two references; start a new run (another "
                              "'job.dump_folder') or restore the settings")
        self.tables, self.loaded = dict(state["tables"]), True

    def lookup(self, section: str, examples: torch.Tensor) -> torch.Tensor:
        values = self.tables[section].to(examples.device)[examples]
        if values.isnan().any():
            raise RuntimeError(f"no precomputed reference log-probabilities for rows {examples.tolist()} ({section})")
        return values


def table_fingerprint(cfg: JobConfig) -> str:
    p, t, v = cfg.preference, cfg.training, cfg.validation
    what = (t.dataset_path, t.seq_len, v.enable and (v.dataset_path, v.seq_len), p.reference, p.truncation_mode,
            p.max_prompt_length, p.chat_template, p.packing, p.prompt_field, p.chosen_field, p.rejected_field,
            p.validation_fraction, cfg.model.hf_assets_path, cfg.model.tokenizer_path)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------ the objective


class PreferenceObjective(Objective):
    """The pair losses of a microbatch's pairs, summed (the trainer divides by the global batch's pairs), plus the NLL
    of the chosen answers' tokens scaled to their mean over the global batch (ORPO, sft_weight). The reference runs
    first, under no_grad, through the runner's forward on the same inputs, and only its per-answer log-probabilities
    are kept (its logits are freed before the policy's forward)."""

    def __init__(self, loss_fn: Callable, spec: PreferenceLoss, reference: Callable | None,
                 table: ReferenceTable | None, cp: ContextParallelSum):
        super().__init__(loss_fn)
        self.spec = spec
        self.frozen = reference  # (forward) -> logits of the reference, or None
        self.table = table
        self.cp = cp
        self.section = "training"
        self.nll_scale = 0.0  # global pairs / global chosen tokens of the step
        self.sums: torch.Tensor | None = None

    @property
    def uses_reference(self) -> bool:
        return not self.spec.reference_free

    def units(self, batch: Batch) -> torch.Tensor:
        return pair_units(batch.labels, batch.documents)

    def start_step(self, global_units: torch.Tensor) -> None:
        pairs, chosen_tokens = global_units.tolist()
        self.nll_scale = pairs / max(chosen_tokens, 1.0)

    def prepare(self, batch: Batch, shard: Callable) -> PairBatch:
        return pair_batch(batch.labels, batch.documents, shard)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Validation: the held-out pairs' precomputed reference, and sums only (no step state changes)."""
        self.section = "validation"
        try:
            yield
        finally:
            self.section = "training"

    def reference(self, forward: Callable[[nn.Module], torch.Tensor],
                  prepared: PairBatch = None) -> torch.Tensor | None:
        """The reference's [pairs, 2] answer log-probabilities (None for reference-free losses)."""
        if not self.uses_reference:
            return None
        if self.table is not None:
            return self.table.lookup(self.section, prepared.examples)
        return self.frozen_logps(forward, prepared)

    @torch.no_grad()
    def frozen_logps(self, forward: Callable[[nn.Module], torch.Tensor], batch: PairBatch,
                     frozen: Callable | None = None) -> torch.Tensor:
        """The [pairs, 2] answer log-probabilities of the reference (`frozen`: another one) on the runner's inputs."""
        logits = (frozen or self.frozen)(forward)
        logps, _ = token_logps(logits, batch.labels)
        del logits
        return self.cp.whole(answer_sums(logps, batch))

    def terms(self, logits: torch.Tensor, batch: PairBatch, reference: torch.Tensor | None):
        """(pair terms, chosen answers' NLL on this rank's tokens, this rank's per-token sums for the metrics)."""
        logps, mean_logits = token_logps(logits, batch.labels)
        local = answer_sums(logps, batch)
        terms = pair_terms(self.spec, self.cp.whole(local), batch.lengths, reference)
        valid = (batch.labels != IGNORE_INDEX).double()
        logit_sums, tokens = answer_sums(mean_logits * valid, batch), answer_sums(valid, batch)
        token_sums = torch.stack([-local[:, 0].detach().sum(), logit_sums[:, 0].sum(), logit_sums[:, 1].sum(),
                                  tokens[:, 0].sum(), tokens[:, 1].sum()])
        return terms, -local[:, 0].sum(), token_sums

    def sums_of(self, terms, token_sums: torch.Tensor) -> torch.Tensor:
        """The metric sums of a microbatch (PAIR_SUMS, then TOKEN_SUMS), ready to be summed over ranks."""
        pairs = torch.stack([torch.ones_like(terms.losses).sum(), terms.losses.detach().sum(),
                             terms.chosen_rewards.sum(), terms.rejected_rewards.sum(),
                             (terms.chosen_rewards > terms.rejected_rewards).double().sum(),
                             terms.chosen_logps.sum(), terms.rejected_logps.sum()]).double()
        return torch.cat([pairs / self.cp.size, token_sums])

    def loss_and_sums(self, logits: torch.Tensor, batch: PairBatch,
                      reference: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the microbatch's loss sum, its metric sums)."""
        terms, nll, token_sums = self.terms(logits, batch, reference)
        loss = self.cp.once(terms.losses.sum())
        if self.spec.nll_weight:
            loss = loss + self.spec.nll_weight * self.nll_scale * nll
        return loss, self.sums_of(terms, token_sums)

    def add_sums(self, sums: torch.Tensor) -> None:
        self.sums = sums if self.sums is None else self.sums + sums

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor, reference: Any = None,
                 prepared: PairBatch = None) -> torch.Tensor:
        loss, sums = self.loss_and_sums(logits, prepared, reference)
        self.add_sums(sums)
        return loss

    @torch.no_grad()
    def eval_sums(self, logits: torch.Tensor, reference: Any, prepared: PairBatch) -> torch.Tensor:
        terms, _, token_sums = self.terms(logits, prepared, reference)
        return self.sums_of(terms, token_sums)

    # ------------------------------------------------------------------ under pipeline parallelism
    # The last stage computes the loss of each pipeline microbatch from a target that carries the labels and the
    # document ids side by side; an on-the-fly reference runs first as a forward-only pipeline pass whose last stage
    # keeps each pair's log-probabilities by its row (context parallelism is refused with pipelines).

    def pipeline_step(self, pipeline, inputs: torch.Tensor, labels: torch.Tensor, batch: Batch, scale: torch.Tensor,
                      extra: dict) -> torch.Tensor:
        target = torch.cat([labels, batch.documents], dim=1)
        reference = self.pipeline_reference(pipeline, inputs, target, extra)
        loss = pipeline.step(inputs, target, scale, extra=extra, target_loss=partial(self._pipeline_loss,
                                                                                     reference=reference))
        for part in pipeline.last_parts:
            self.add_sums(part)
        return loss

    @torch.no_grad()
    def pipeline_eval_sums(self, pipeline, batch: Batch, extra: dict) -> torch.Tensor:
        inputs, target = batch.inputs, torch.cat([batch.labels, batch.documents], dim=1)
        reference = self.pipeline_reference(pipeline, inputs, target, extra)
        pipeline.evaluate(inputs, target, extra, partial(self._pipeline_loss, reference=reference))
        zero = torch.zeros(len(PAIR_SUMS + TOKEN_SUMS), dtype=torch.float64, device=inputs.device)
        return sum(pipeline.last_parts, zero)

    @torch.no_grad()
    def pipeline_reference(self, pipeline, inputs: torch.Tensor, target: torch.Tensor, extra: dict,
                           frozen: FrozenForward | None = None) -> "StepReference | None":
        """The reference's log-probabilities of a batch's pairs by row, from a forward-only pass (on the last
        stage; empty elsewhere); None when they come from the table or no reference is used."""
        frozen = frozen or self.frozen
        if not self.uses_reference or frozen is None:
            return None
        runs = frozen.pipeline or pipeline
        with frozen.context():
            runs.evaluate(inputs, target, extra, self._pipeline_reference_part)
        parts = runs.last_parts
        if not parts:
            return StepReference(torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, dtype=torch.float64))
        return StepReference(torch.cat([examples for examples, _ in parts]), torch.cat([v for _, v in parts]))

    def _pipeline_reference_part(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        batch = _target_batch(target)
        logps, _ = token_logps(output, batch.labels)
        return torch.zeros((), device=output.device), (batch.examples, answer_sums(logps, batch))

    def _pipeline_loss(self, output: torch.Tensor, target: torch.Tensor,
                       reference: "StepReference | None") -> tuple[torch.Tensor, torch.Tensor]:
        batch = _target_batch(target)
        if not self.uses_reference:
            values = None
        elif reference is None:
            values = self.table.lookup(self.section, batch.examples)
        else:
            values = reference.lookup(batch.examples)
        if not torch.is_grad_enabled():  # evaluation
            terms, _, token_sums = self.terms(output, batch, values)
            return torch.zeros((), device=output.device), self.sums_of(terms, token_sums)
        return self.loss_and_sums(output, batch, values)

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """TRL's metrics (and the loss) from the global sums of PAIR_SUMS and TOKEN_SUMS."""
        s = dict(zip(PAIR_SUMS + TOKEN_SUMS, sums.tolist(), strict=True))
        pairs, chosen_tokens = max(s["pairs"], 1.0), max(s["tokens/chosen"], 1.0)
        out = {"loss": s["pair_loss"] / pairs + self.spec.nll_weight * s["nll"] / chosen_tokens}
        out |= {name: s[name] / pairs for name in ("rewards/chosen", "rewards/rejected")}
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        out |= {name: s[name] / pairs for name in ("rewards/accuracies", "logps/chosen", "logps/rejected")}
        out["logits/chosen"] = s["logits/chosen"] / chosen_tokens
        out["logits/rejected"] = s["logits/rejected"] / max(s["tokens/rejected"], 1.0)
        if self.spec.nll_weight:
            out["nll_loss"] = s["nll"] / chosen_tokens
        return out

    def step_metrics(self, global_sum: Callable[[torch.Tensor], torch.Tensor],
                     global_units: torch.Tensor) -> dict[str, float]:
        sums, self.sums = self.sums, None
        if sums is None:  # a pipeline stage without the loss
            sums = torch.zeros(len(PAIR_SUMS + TOKEN_SUMS), dtype=torch.float64, device=global_units.device)
        metrics = self.metrics(global_sum(sums))
        del metrics["loss"]  # the training line prints the loss itself
        return metrics


# ------------------------------------------------------------------------------------------ checks and building


def check_preference(plan: JobPlan) -> None:
    """Before launch: a reference that can serve: 'base' needs adapters that keep the base apart (and no module
    trained in full, no adapter loaded to start from: switching the adapters off would not give the model training
    starts from); a folder must be usable (files, shapes, vocabulary, tokenizer)."""
    reference_of(plan.cfg).check(plan, check_base)


def check_base(plan: JobPlan) -> None:
    fix = None if plan.cfg.preference.precompute_reference else \
        "set 'preference.precompute_reference' = true (the reference is computed before training) or name a " \
        "reference folder"
    check_base_reference(plan, "preference.reference", trains_in_full_fix=fix)


def reference_files_problem(cfg: JobConfig) -> str | None:
    """DRY_RUN's checklist line for a reference folder not downloaded yet, or None."""
    return reference_of(cfg).files_problem(cfg)


def build_preference(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> PreferenceObjective:
    """The objective with its reference: none, the policy's base, a frozen model assembled here, or (precomputed) a
    table filled by `PreferenceRun.start` before training."""
    cfg, spec = plan.cfg, loss_spec(plan.cfg)
    dims = plan.parallel_dims
    cp = ContextParallelSum(dims.submesh("cp").get_group() if dims.cp_enabled else None, dims.cp)
    reference, precompute = reference_of(cfg), cfg.preference.precompute_reference
    kind = reference.kind
    table = ReferenceTable(table_fingerprint(cfg)) if precompute else None
    frozen = None if precompute else reference.load(plan, model, device, seed)
    if kind == BASE and not precompute:
        logger.info(f"preference: {spec.describe()}; the reference is the policy's own base, its adapters switched "
                    "off (no second copy)")
    elif kind is not None and not precompute:
        logger.info(f"preference: {spec.describe()}; {frozen.describe(reference.spec)}")
    elif kind is None:
        logger.info(f"preference: {spec.describe()} (reference-free: no reference model)")
    else:
        which = "the policy's base" if kind == "base" else f"'{cfg.preference.reference}'"
        logger.info(f"preference: {spec.describe()}; the reference ({which}) is precomputed before the first step")
    return PreferenceObjective(model.runner.loss_fn, spec, frozen, table, cp)
