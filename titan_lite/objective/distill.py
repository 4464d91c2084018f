"""Distillation as the training objective ([distill]): a frozen teacher (objective/frozen.py: assembled by the same job
plan and mesh as the student, or the student's own base with its adapters switched off), whose logits on the same
inputs train the student through the chunked loss of kd.py; its checks before launch and its DRY_RUN lines."""

import logging
from collections.abc import Callable

import torch
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import BuiltModel
from titan_lite.job.estimate import compute_bytes, microbatching
from titan_lite.job.plan import JobPlan
from titan_lite.objective import kd
from titan_lite.objective.base import Objective
from titan_lite.objective.frozen import FrozenSpec
from titan_lite.objective.kd import DistillLoss, distill_loss_sum
from titan_lite.objective.reference import BASE, Reference
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms import PlanItem

logger = logging.getLogger("titan_lite")
SELF_TEACHER = BASE


def self_teacher(cfg: JobConfig) -> bool:
    return cfg.distill.teacher_path == SELF_TEACHER


def teacher_spec(cfg: JobConfig) -> FrozenSpec:
    d = cfg.distill
    return FrozenSpec(d.teacher_path, d.teacher_flavor, d.teacher_config, "teacher", "distill.teacher_path",
                      "distill.teacher_flavor", "distill.teacher_config", "student",
                      "distillation compares their logits token by token")


def teacher(cfg: JobConfig) -> Reference:
    """The student's own base, or a teacher folder."""
    return Reference.of(teacher_spec(cfg))


def describe(cfg: JobConfig) -> str:
    d = cfg.distill
    return f"alpha {d.alpha:g}, temperature {d.temperature:g}, {d.kind} KL"


class DistillObjective(Objective):
    """alpha T^2 KL(teacher || student) (or reverse) + (1 - alpha) CE on the trained tokens. The teacher runs first,
    under no_grad, through the runner's forward; the KL and CE sums of the step are logged separately."""

    def __init__(self, loss_fn: Callable, spec: DistillLoss, teacher: Callable):
        super().__init__(loss_fn)
        self.spec = spec
        self.teacher = teacher  # (forward) -> logits
        self.parts: torch.Tensor | None = None  # this rank's [KL sum, CE sum] since the last step_metrics

    def reference(self, forward: Callable[[nn.Module], torch.Tensor], prepared=None) -> torch.Tensor:
        """The teacher's logits."""
        with torch.no_grad():
            return self.teacher(forward)

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor | None = None,
                 prepared=None) -> torch.Tensor:
        loss, parts = distill_loss_sum(logits, reference, labels, self.spec)
        parts = parts.double()
        self.parts = parts if self.parts is None else self.parts + parts
        return loss

    def step_metrics(self, global_sum: Callable[[torch.Tensor], torch.Tensor],
                     global_units: torch.Tensor) -> dict[str, float]:
        """The step's KL (at the temperature, before T^2 and alpha) and cross entropy per trained token."""
        parts, self.parts = self.parts, None
        kl, ce = (global_sum(parts) / global_units[0]).tolist()
        return {"distill/kl": kl, "distill/ce": ce}


def check_distill(plan: JobPlan) -> None:
    """Before launch: the teacher is usable (its files, shapes, vocabulary, tokenizer), or the self-teacher has a
    transform that keeps a base apart from what trains."""
    teacher(plan.cfg).check(plan, check_self_teacher)


def check_self_teacher(plan: JobPlan) -> None:
    cfg = plan.cfg
    if plan.transforms.base_function([]) is None:
        raise ConfigError(f"'distill.teacher_path' = '{SELF_TEACHER}' runs the student's frozen base as the "
                          f"teacher, but no transform of 'model.converters' = {cfg.model.converters} keeps a base "
                          "apart from what it trains (adapters do); name a teacher folder instead")
    if cfg.distill.alpha == 1:
        raise ConfigError(f"'distill.teacher_path' = '{SELF_TEACHER}' with 'distill.alpha' = 1: the student starts "
                          "as its own base, so the KL and its gradient are zero and nothing would train; set "
                          "alpha below 1 (the KL then keeps the fine-tuned model near its base)")


def teacher_files_problem(cfg: JobConfig) -> str | None:
    """DRY_RUN's checklist line for a teacher not downloaded yet, or None."""
    return teacher(cfg).files_problem(cfg)


def build_distill(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int,
                  loss_fn: Callable) -> DistillObjective:
    """Distillation with its teacher assembled here (loaded, frozen), or the student's own base."""
    d = plan.cfg.distill
    spec = DistillLoss(d.alpha, d.temperature, d.kind)
    frozen = teacher(plan.cfg).load(plan, model, device, seed)
    if frozen.plan is None:
        logger.info(f"distill: the teacher is the student's own base, its adapters switched off "
                    f"({describe(plan.cfg)})")
    else:
        logger.info(f"distill: {frozen.describe(teacher_spec(plan.cfg))} ({describe(plan.cfg)})")
    return DistillObjective(loss_fn, spec, frozen)


# ------------------------------------------------------------------------------------------ DRY_RUN


def distill_teacher_plan(plan: JobPlan, files_there: bool) -> JobPlan | None:
    """The teacher's DRY_RUN plan (from its folder, or from teacher_flavor when not there yet); None for the
    self-teacher."""
    if self_teacher(plan.cfg):
        check_distill(plan)
    return teacher(plan.cfg).dry_run_plan(plan, files_there)


def distill_lines(plan: JobPlan, teacher: JobPlan | None) -> list[str]:
    d = plan.cfg.distill
    if teacher is None:
        return [f"distill: self-teacher (the student's base, adapters off; no second copy), {describe(plan.cfg)}"]
    return [f"distill: teacher {teacher.cfg.model.flavor} from '{d.teacher_path}', {teacher.full_param_count():,} "
            f"parameters in {teacher.cfg.training.dtype}, frozen (no gradients or optimizer state), sharded like the "
            f"student; {describe(plan.cfg)}"]


def distill_memory(plan: JobPlan) -> Callable[[JobConfig, ParallelDims], list[PlanItem]]:
    """One rank's extra bytes besides the teacher's weights: the teacher's logits alive through the student's
    forward, and the loss's float32 blocks."""
    def items(cfg: JobConfig, dims: ParallelDims) -> list[PlanItem]:
        c = compute_bytes(cfg)[0]
        microbatch, _ = microbatching(cfg, dims)
        tokens = microbatch * cfg.training.seq_len // dims.cp
        vocab = plan.model_args.vocab_size
        sharded = dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
        local_vocab = -(-vocab // dims.tp) if sharded else vocab
        chunk = kd._CHUNK_ELEMENTS if cfg.dry_run.device_type == "cpu" else kd._ACCELERATOR_CHUNK_ELEMENTS
        return [PlanItem("activations", tokens * local_vocab * c,
                         f"teacher logits {tokens:,} x {local_vocab:,} (the loss writes the gradient into them)"),
                PlanItem("buffers", 6 * chunk * 4, "distillation loss: six float32 row blocks")]
    return items
