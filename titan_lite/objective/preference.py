"""Preference tuning as the training objective ([preference]): pairs packed as documents (data/preference.py) give
every answer's log-probability (summed over its tokens, chunked: objective/logps.py); the pair losses of
preference_loss.py compare them with the reference's: the policy with its adapters off ('base'), a frozen model on
the policy's mesh (objective/frozen.py), or a table computed in one pass before training and checkpointed with the
run. TRL's metrics (rewards/*, logps/*, logits/*) are logged for training and for the held-out pairs."""

import contextlib
import gc
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.data.dataloader import build_section_source, pad_collate
from titan_lite.data.preference import CHOSEN
from titan_lite.distributed import device_type
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import BuiltModel
from titan_lite.job.estimate import compute_bytes
from titan_lite.job.plan import JobPlan
from titan_lite.loss import IGNORE_INDEX, Objective
from titan_lite.metrics.logger import Progress
from titan_lite.objective.frozen import (
    FrozenForward,
    FrozenSpec,
    assemble_frozen,
    base_forward,
    check_frozen,
    frozen_files_problem,
    frozen_items,
    frozen_plan,
    separate_forward,
)
from titan_lite.objective.logps import token_logps
from titan_lite.objective.preference_loss import PreferenceLoss, pair_terms
from titan_lite.objective.vocab import ACCELERATOR_CHUNK_ELEMENTS, CHUNK_ELEMENTS
from titan_lite.parallel.memory_estimate import GIB
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms import PassPlan, PlanItem

logger = logging.getLogger("titan_lite")
BASE_REFERENCE = "base"
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


def reference_kind(cfg: JobConfig) -> str | None:
    """None (a reference-free loss), 'base' (the policy with its adapters off) or 'path' (a frozen model)."""
    if loss_spec(cfg).reference_free:
        return None
    return "base" if cfg.preference.reference == BASE_REFERENCE else "path"


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

    def units(self, labels: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        return pair_units(labels, documents)

    def start_step(self, global_units: torch.Tensor) -> None:
        pairs, chosen_tokens = global_units.tolist()
        self.nll_scale = pairs / max(chosen_tokens, 1.0)

    def prepare(self, labels: torch.Tensor, documents: torch.Tensor | None, shard: Callable) -> PairBatch:
        return pair_batch(labels, documents, shard)

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

    def pipeline_step(self, pipeline, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None,
                      scale: torch.Tensor, extra: dict) -> torch.Tensor:
        target = torch.cat([labels, documents], dim=1)
        reference = self.pipeline_reference(pipeline, inputs, target, extra)
        loss = pipeline.step(inputs, target, scale, extra=extra, target_loss=partial(self._pipeline_loss,
                                                                                     reference=reference))
        for part in pipeline.last_parts:
            self.add_sums(part)
        return loss

    @torch.no_grad()
    def pipeline_eval_sums(self, pipeline, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor,
                           extra: dict) -> torch.Tensor:
        target = torch.cat([labels, documents], dim=1)
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
    cfg = plan.cfg
    kind = reference_kind(cfg)
    if kind == "base":
        if plan.transforms.base_function([]) is None:
            raise ConfigError(f"'preference.reference' = '{BASE_REFERENCE}' runs the policy with its adapters switched "
                              f"off as the reference, but no transform of 'model.converters' = {cfg.model.converters} "
                              "keeps a base apart from what it trains: the policy would equal its reference (nothing "
                              "to learn); add adapters (--model.converters lora) or name a reference folder")
        lora = cfg.lora if "lora" in cfg.model.converters else None
        if lora is not None and lora.train_modules and not cfg.preference.precompute_reference:
            raise ConfigError(f"'preference.reference' = '{BASE_REFERENCE}' with 'lora.train_modules' = "
                              f"{lora.train_modules}: those modules train in full, so switching the adapters off "
                              "stops giving the base after the first step; set 'preference.precompute_reference' = "
                              "true (the reference is computed before training) or name a reference folder")
        if lora is not None and lora.adapter_path:
            raise ConfigError(f"'preference.reference' = '{BASE_REFERENCE}' with 'lora.adapter_path' = "
                              f"'{lora.adapter_path}': switching the adapters off gives the model before that "
                              "adapter, not the one training starts from; merge it into its base "
                              "(scripts/merge_lora.py) and train new adapters on the merged folder, or name the "
                              "merged folder in 'preference.reference'")
    elif kind == "path":
        check_frozen(plan, reference_spec(cfg), device_type())


def reference_files_problem(cfg: JobConfig) -> str | None:
    """DRY_RUN's checklist line for a reference folder not downloaded yet, or None."""
    return frozen_files_problem(cfg, reference_spec(cfg)) if reference_kind(cfg) == "path" else None


def build_preference(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> PreferenceObjective:
    """The objective with its reference: none, the policy's base, a frozen model assembled here, or (precomputed) a
    table filled by `PreferenceRun.start` before training."""
    cfg, spec = plan.cfg, loss_spec(plan.cfg)
    dims = plan.parallel_dims
    cp = ContextParallelSum(dims.submesh("cp").get_group() if dims.cp_enabled else None, dims.cp)
    kind, precompute = reference_kind(cfg), cfg.preference.precompute_reference
    table = ReferenceTable(table_fingerprint(cfg)) if precompute else None
    frozen = None
    if kind == "base" and not precompute:
        frozen = base_forward(plan, model)
        logger.info(f"preference: {spec.describe()}; the reference is the policy's own base, its adapters switched "
                    "off (no second copy)")
    elif kind == "path" and not precompute:
        tplan, built = assemble_frozen(plan, reference_spec(cfg), device, seed)
        frozen = separate_forward(built)
        logger.info(f"preference: {spec.describe()}; reference {tplan.cfg.model.flavor} from "
                    f"'{cfg.preference.reference}', {tplan.full_param_count():,} parameters ({built.param_count():,} "
                    f"held by this rank, {tplan.cfg.training.dtype}, frozen)")
    elif kind is None:
        logger.info(f"preference: {spec.describe()} (reference-free: no reference model)")
    else:
        which = "the policy's base" if kind == "base" else f"'{cfg.preference.reference}'"
        logger.info(f"preference: {spec.describe()}; the reference ({which}) is precomputed before the first step")
    return PreferenceObjective(model.runner.loss_fn, spec, frozen, table, cp)


class ReferencePass:
    """precompute_reference: the reference's log-probabilities of every pair of the training (and held-out) split,
    computed before the first step through the runner on this layout (each data-parallel rank its share of the
    windows, in batches of training.local_batch_size), then the reference is freed."""

    def __init__(self, plan: JobPlan, model: BuiltModel, objective: PreferenceObjective, device: torch.device,
                 seed: int):
        self.plan, self.model, self.objective, self.device, self.seed = plan, model, objective, device, seed

    def run(self) -> None:
        table, cfg = self.objective.table, self.plan.cfg
        if table.loaded:
            counts = ", ".join(f"{int((~t[:, 0].isnan()).sum()):,} {name}" for name, t in table.tables.items())
            logger.info(f"preference: the reference log-probabilities come from the checkpoint ({counts} pairs), "
                        "not recomputed")
            return
        started = time.perf_counter()
        frozen, built = self.reference()
        sections = ["training"] + (["validation"] if cfg.validation.enable else [])
        for section in sections:
            table.tables[section] = self.compute(section, frozen)
        del frozen, built
        gc.collect()
        counts = ", ".join(f"{int((~table.tables[s][:, 0].isnan()).sum()):,} {s}" for s in sections)
        logger.info(f"preference: reference log-probabilities of {counts} pairs computed in "
                    f"{time.perf_counter() - started:.1f}s and kept with the checkpoints; the reference is freed")

    def reference(self) -> tuple[Callable, BuiltModel | None]:
        cfg = self.plan.cfg
        if reference_kind(cfg) == "base":
            return base_forward(self.plan, self.model), None
        tplan, built = assemble_frozen(self.plan, reference_spec(cfg), self.device, self.seed)
        logger.info(f"preference: reference {tplan.cfg.model.flavor} from '{cfg.preference.reference}' loaded for "
                    "the precomputation")
        return separate_forward(built), built

    def values(self, frozen: FrozenForward, inputs: torch.Tensor, labels: torch.Tensor,
               documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, [pairs, 2] reference log-probabilities) of one batch's pairs (under pipeline parallelism: on the
        last stage, none elsewhere)."""
        runner = self.model.runner
        if runner.pipeline is not None:
            found = self.objective.pipeline_reference(runner.pipeline, inputs, torch.cat([labels, documents], dim=1),
                                                      runner.extra_inputs(documents), frozen)
            return found.examples.to(self.device), found.values
        batch = pair_batch(labels, documents, runner.shard)
        return batch.examples, runner.forward_only(partial(self.objective.frozen_logps, batch=batch, frozen=frozen),
                                                   inputs, documents)

    @torch.no_grad()
    def compute(self, section: str, frozen: FrozenForward) -> torch.Tensor:
        cfg, dims = self.plan.cfg, self.plan.parallel_dims
        source = build_section_source(cfg, section, self.plan.tokenizer, infinite=False)
        windows = [sample for sample, _ in source.samples()]
        rows = max(int(docs.max()) for _, _, docs in windows) // 2 + 1
        batch_mesh = dims.submesh("batch")
        mine = windows[batch_mesh.get_local_rank()::batch_mesh.size()]
        size = getattr(cfg, section).local_batch_size
        count = math.ceil(math.ceil(len(windows) / batch_mesh.size()) / size)  # batches on every rank alike
        table = torch.zeros(rows, 2, dtype=torch.float64, device=self.device)
        seen = torch.zeros(rows, dtype=torch.float64, device=self.device)
        pad_id = self.plan.tokenizer.pad_id if self.plan.tokenizer.pad_id >= 0 else self.plan.tokenizer.eos_id
        collate = pad_collate(pad_id, IGNORE_INDEX, dims.cp * 2)
        progress = Progress(f"reference log-probabilities ({section})", count, "batches", announce=True)
        for i in range(count):
            progress.update(i)
            chunk = mine[i * size:(i + 1) * size]
            chunk += [_padding_window(windows[0])] * (size - len(chunk))  # whole batches: pipelines need them
            *tensors, _ = collate([(w, {}) for w in chunk])
            inputs, labels, documents = (t.to(self.device) for t in tensors)
            examples, values = self.values(frozen, inputs, labels, documents)
            if examples.numel():
                table[examples] = values.to(table.device)
                seen[examples] = 1
        _sum_over(table, seen, dims)
        table[seen == 0] = float("nan")
        return table.cpu()


def _padding_window(window: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A window of padding only: a rank with fewer windows runs it, so every rank runs the same forwards."""
    inputs, labels, documents = window
    return inputs, torch.full_like(labels, IGNORE_INDEX), torch.full_like(documents, -1)


def _sum_over(table: torch.Tensor, seen: torch.Tensor, dims: ParallelDims) -> None:
    """Each pair was computed by one data-parallel rank (by the last pipeline stage): the others hold zeros."""
    for name, enabled in (("batch", dims.dp_degree > 1), ("pp", dims.pp_enabled)):
        if enabled:
            group = dims.submesh(name).get_group()
            dist.all_reduce(table, group=group)
            dist.all_reduce(seen, group=group)


# ------------------------------------------------------------------------------------------ DRY_RUN


def preference_reference_plan(plan: JobPlan, files_there: bool) -> tuple[JobPlan | None, bool]:
    """(the reference's plan, whether training holds it): None for 'base' and reference-free losses; a folder's
    reference is held through training unless precomputed (then only during the pass before it)."""
    kind = reference_kind(plan.cfg)
    if kind != "path":
        if kind == "base":
            check_preference(plan)
        return None, False
    reference = frozen_plan(plan if files_there else replace(plan, tokenizer=None), reference_spec(plan.cfg),
                            plan.cfg.dry_run.device_type)
    return reference, not plan.cfg.preference.precompute_reference


def preference_lines(plan: JobPlan, reference: JobPlan | None) -> list[str]:
    cfg = plan.cfg
    p, spec, kind = cfg.preference, loss_spec(cfg), reference_kind(cfg)
    if kind is None:
        where = "reference-free: no reference model"
    elif kind == "base":
        where = "reference: the policy's own base, adapters off (no second copy)"
    else:
        where = (f"reference: {reference.cfg.model.flavor} from '{p.reference}', {reference.full_param_count():,} "
                 f"parameters in {reference.cfg.training.dtype}, frozen, sharded like the policy")
    if kind is not None:
        where += ("; precomputed in one forward pass over the pairs before training (then freed), kept as 2 float64 "
                  "per pair with the checkpoints" if p.precompute_reference
                  else "; one forward per microbatch without gradients before the policy's (its logits freed first)")
    window = cfg.training.seq_len + 1
    layout = (f"packed whole into windows of seq_len + 1 = {window:,} tokens" if p.packing
              else f"one pair per sequence of up to {window:,} tokens, padded to the longest of its batch")
    lines = [f"preference: {spec.describe()}; {where}",
             f"preference pairs: two block-causal documents each (prompt + chosen, prompt + rejected: the prompt "
             f"twice), {layout}; the loss averages over the global batch's pairs"]
    return lines + ([line] if (line := pair_statistics(cfg, plan.tokenizer)) else [])


def pair_statistics(cfg: JobConfig, tokenizer, windows: int = 64) -> str | None:
    """What the first sequences of the training data hold (pairs, and how their tokens divide into the prompts'
    two copies, the answers and padding), or None when the tokenizer or the data are not there yet."""
    if tokenizer is None:
        return None
    try:
        source = build_section_source(cfg, "training", tokenizer, infinite=False)
        samples = [sample for (sample, _), _ in zip(source.samples(), range(windows), strict=False)]
    except ConfigError:
        return None
    pairs = sum(len({int(d) // 2 for d in docs.tolist() if d >= 0}) for _, _, docs in samples)
    tokens = sum(docs.numel() for _, _, docs in samples)
    padding = sum(int((docs < 0).sum()) for _, _, docs in samples)
    answers = sum(int((labels >= 0).sum()) for _, labels, _ in samples)
    share = [100 * n / max(tokens, 1) for n in (tokens - padding - answers, answers, padding)]
    per = pairs / max(len(samples), 1)
    return (f"preference data: the first {len(samples)} sequences hold {pairs:,} pairs ({per:.1f} per sequence); "
            f"their tokens: {share[0]:.1f}% prompts (each twice), {share[1]:.1f}% answers (trained), "
            f"{share[2]:.1f}% padding")


def preference_memory(plan: JobPlan) -> Callable[[JobConfig, ParallelDims], list[PlanItem]]:
    """One rank's extra bytes besides a held reference's weights: the log-probabilities' float32 row blocks (their
    probabilities in the logits' dtype are the loss's saved tensor of the activations row)."""
    def items(cfg: JobConfig, dims: ParallelDims) -> list[PlanItem]:
        chunk = CHUNK_ELEMENTS if cfg.dry_run.device_type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
        return [PlanItem("buffers", 3 * chunk * 4, "preference log-probabilities: three float32 row blocks")]
    return items


def preference_passes(plan: JobPlan, reference: JobPlan | None):
    """The pass before training of a precomputed reference folder: the policy's weights, the reference's, and one
    forward without gradients (its logits and row blocks); none when no separate reference is loaded for it."""
    def passes(cfg: JobConfig, dims: ParallelDims, estimate) -> list[PassPlan]:
        if reference is None:
            return []
        c = compute_bytes(cfg)[0]
        held = frozen_items(reference, dims, c, "reference")
        tokens = cfg.training.local_batch_size * cfg.training.seq_len // dims.cp
        sharded = dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
        vocab = -(-plan.model_args.vocab_size // dims.tp) if sharded else plan.model_args.vocab_size
        chunk = CHUNK_ELEMENTS if cfg.dry_run.device_type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
        forward = tokens * vocab * c + 3 * chunk * 4 + tokens * plan.model_args.dim * c * 4
        rows = [f"  {'policy':<12}{estimate.parameters / GIB:9.2f} GiB  its parameters (no gradients or optimizer "
                "state yet)", *(f"  {'reference':<12}{item.nbytes / GIB:9.2f} GiB  {item.note}" for item in held),
                f"  {'forward':<12}{forward / GIB:9.2f} GiB  logits {tokens:,} x {vocab:,} without gradients, "
                "three float32 row blocks and a layer's hidden states"]
        peak = estimate.parameters + sum(item.nbytes for item in held) + forward
        rows.append(f"  {'peak':<12}{peak / GIB:9.2f} GiB")
        return [PassPlan("the reference's precomputation",
                         f"precomputing the reference's log-probabilities before training ('{cfg.preference.reference}'"
                         " loaded for the pass, then freed), per device:", rows, peak,
                         "shard over more devices, or lower 'training.local_batch_size' (the pass's batch)")]
    return passes
