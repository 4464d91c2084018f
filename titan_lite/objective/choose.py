"""The one chooser of the training objective, a table of cross entropy, distillation, preference tuning and GRPO:
each one's checks before launch, its building (with the frozen model it holds), its work before the first step and
its DRY_RUN plan."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from titan_lite.config.schema import JobConfig
from titan_lite.job.assembly import BuiltModel
from titan_lite.job.estimate import compute_bytes
from titan_lite.job.plan import JobPlan
from titan_lite.objective.base import Objective
from titan_lite.objective.distill import (
    build_distill,
    check_distill,
    distill_lines,
    distill_memory,
    distill_teacher_plan,
    teacher_files_problem,
)
from titan_lite.objective.frozen import frozen_items
from titan_lite.objective.grpo import build_grpo, check_grpo, grpo_reference_problem
from titan_lite.objective.grpo_plan import grpo_lines, grpo_memory, grpo_passes, grpo_reference_plan
from titan_lite.objective.preference import build_preference, check_preference, reference_files_problem
from titan_lite.objective.preference_plan import (
    preference_lines,
    preference_memory,
    preference_passes,
    preference_reference_plan,
)
from titan_lite.objective.reference_pass import ReferencePass
from titan_lite.parallel.memory_estimate import MemoryEstimate
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms import PassPlan, PlanItem


@dataclass
class TrainingObjective:
    """The objective the trainer holds (and hands to the runner), what it checkpoints (name -> stateful) and what it
    does before the first step."""

    objective: Objective
    states: dict = field(default_factory=dict)
    before_training: Callable[[], None] = lambda: None


def build_cross_entropy(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> TrainingObjective:
    return TrainingObjective(Objective(model.runner.loss_fn))


def build_distillation(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> TrainingObjective:
    return TrainingObjective(build_distill(plan, model, device, seed, model.runner.loss_fn))


def build_grpo_objective(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> TrainingObjective:
    return TrainingObjective(build_grpo(plan, model, device, seed))


def build_preference_objective(plan: JobPlan, model: BuiltModel, device: torch.device,
                               seed: int) -> TrainingObjective:
    """Preference tuning; a precomputed reference's table is checkpointed and filled before the first step."""
    objective = build_preference(plan, model, device, seed)
    if objective.table is None:
        return TrainingObjective(objective)
    return TrainingObjective(objective, {"preference_reference": objective.table},
                             ReferencePass(plan, model, objective, device, seed).run)


# ------------------------------------------------------------------------------------------ DRY_RUN


@dataclass
class ObjectivePlan:
    """What DRY_RUN prints and counts for the objective: its lines, the frozen model it holds through training (None:
    none, or not through training), and its own memory besides that model (logits, row blocks)."""

    lines: list[str]
    frozen: JobPlan | None
    role: str
    extra: Callable[[JobConfig, ParallelDims], list[PlanItem]]
    passes: Callable[[JobConfig, ParallelDims, MemoryEstimate], list[PassPlan]] = lambda cfg, dims, estimate: []

    def memory(self, cfg: JobConfig, dims: ParallelDims) -> list[PlanItem]:
        """One rank's extra bytes (`dims`: that rank's layout)."""
        items = frozen_items(self.frozen, dims, compute_bytes(cfg)[0], self.role) if self.frozen is not None else []
        return items + self.extra(cfg, dims)

    def pass_plans(self, cfg: JobConfig, dims: ParallelDims, estimate: MemoryEstimate) -> list[PassPlan]:
        """The passes the objective runs before training on one rank (a precomputed reference's)."""
        return self.passes(cfg, dims, estimate)


def plan_distill(plan: JobPlan) -> ObjectivePlan:
    teacher = distill_teacher_plan(plan, teacher_files_problem(plan.cfg) is None)
    return ObjectivePlan(distill_lines(plan, teacher), teacher, "teacher", distill_memory(plan))


def plan_grpo(plan: JobPlan) -> ObjectivePlan:
    reference = grpo_reference_plan(plan, grpo_reference_problem(plan.cfg) is None)
    return ObjectivePlan(grpo_lines(plan, reference), reference, "reference", grpo_memory(plan), grpo_passes(plan))


def plan_preference(plan: JobPlan) -> ObjectivePlan:
    reference, held = preference_reference_plan(plan, reference_files_problem(plan.cfg) is None)
    return ObjectivePlan(preference_lines(plan, reference), reference if held else None, "reference",
                         preference_memory(plan), preference_passes(plan, None if held else reference))


# ------------------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class ObjectiveKind:
    """What the chooser asks of one objective: its check before launch, DRY_RUN's checklist line for its frozen
    model's files (or None), its building (with the frozen model it holds) and its DRY_RUN plan (or None)."""

    check: Callable[[JobPlan], None]
    files_problem: Callable[[JobConfig], str | None]
    build: Callable[[JobPlan, BuiltModel, torch.device, int], TrainingObjective]
    plan: Callable[[JobPlan], ObjectivePlan | None]


OBJECTIVES = {
    "cross_entropy": ObjectiveKind(lambda plan: None, lambda cfg: None, build_cross_entropy, lambda plan: None),
    "distill": ObjectiveKind(check_distill, teacher_files_problem, build_distillation, plan_distill),
    "preference": ObjectiveKind(check_preference, reference_files_problem, build_preference_objective,
                                plan_preference),
    "grpo": ObjectiveKind(check_grpo, grpo_reference_problem, build_grpo_objective, plan_grpo),
}
# The objective a training dataset implies when distillation is off.
DATASET_OBJECTIVES = {"preference": "preference", "prompts": "grpo"}


def objective_name(cfg: JobConfig) -> str:
    return "distill" if cfg.distill.enable else DATASET_OBJECTIVES.get(cfg.training.dataset, "cross_entropy")


def objective_kind(cfg: JobConfig) -> ObjectiveKind:
    return OBJECTIVES[objective_name(cfg)]


def check_objective(plan: JobPlan) -> None:
    """Before launch: the objective's frozen model (teacher, reference) is usable."""
    objective_kind(plan.cfg).check(plan)


def objective_files_problem(cfg: JobConfig) -> str | None:
    """DRY_RUN's checklist line for the objective's frozen model not downloaded yet, or None."""
    return objective_kind(cfg).files_problem(cfg)


def build_objective(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> TrainingObjective:
    """Cross entropy, distillation (its teacher assembled here), preference tuning or GRPO (their reference)."""
    return objective_kind(plan.cfg).build(plan, model, device, seed)


def plan_objective(plan: JobPlan) -> ObjectivePlan | None:
    """The objective's DRY_RUN plan (a frozen model from its folder, or from its flavor when not there yet)."""
    return objective_kind(plan.cfg).plan(plan)
