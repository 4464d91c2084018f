"""The one chooser of the training objective (cross entropy, distillation, preference tuning, GRPO): its checks
before launch, its building (with the frozen model it holds), its work before the first step and its DRY_RUN plan."""

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


def objective_name(cfg: JobConfig) -> str:
    if cfg.distill.enable:
        return "distill"
    return {"preference": "preference", "prompts": "grpo"}.get(cfg.training.dataset, "cross_entropy")


def check_objective(plan: JobPlan) -> None:
    """Before launch: the objective's frozen model (teacher, reference) is usable."""
    name = objective_name(plan.cfg)
    if name == "distill":
        check_distill(plan)
    elif name == "preference":
        check_preference(plan)
    elif name == "grpo":
        check_grpo(plan)


def objective_files_problem(cfg: JobConfig) -> str | None:
    """DRY_RUN's checklist line for the objective's frozen model not downloaded yet, or None."""
    name = objective_name(cfg)
    if name == "distill":
        return teacher_files_problem(cfg)
    if name == "grpo":
        return grpo_reference_problem(cfg)
    return reference_files_problem(cfg) if name == "preference" else None


@dataclass
class TrainingObjective:
    """The runner's objective, what it checkpoints (name -> stateful) and what it does before the first step."""

    objective: Objective
    states: dict = field(default_factory=dict)
    before_training: Callable[[], None] = lambda: None


def build_objective(plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> TrainingObjective:
    """Cross entropy, distillation (its teacher assembled here), preference tuning or GRPO (their reference)."""
    name = objective_name(plan.cfg)
    if name == "distill":
        return TrainingObjective(build_distill(plan, model, device, seed, model.runner.loss_fn))
    if name == "grpo":
        return TrainingObjective(build_grpo(plan, model, device, seed))
    if name == "preference":
        objective = build_preference(plan, model, device, seed)
        if objective.table is None:
            return TrainingObjective(objective)
        return TrainingObjective(objective, {"preference_reference": objective.table},
                                 ReferencePass(plan, model, objective, device, seed).run)
    return TrainingObjective(Objective(model.runner.loss_fn))


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


def plan_objective(plan: JobPlan) -> ObjectivePlan | None:
    """The objective's DRY_RUN plan (a frozen model from its folder, or from its flavor when not there yet)."""
    name = objective_name(plan.cfg)
    if name == "distill":
        teacher = distill_teacher_plan(plan, teacher_files_problem(plan.cfg) is None)
        return ObjectivePlan(distill_lines(plan, teacher), teacher, "teacher", distill_memory(plan))
    if name == "grpo":
        reference = grpo_reference_plan(plan, grpo_reference_problem(plan.cfg) is None)
        return ObjectivePlan(grpo_lines(plan, reference), reference, "reference", grpo_memory(plan),
                             grpo_passes(plan))
    if name == "preference":
        reference, held = preference_reference_plan(plan, reference_files_problem(plan.cfg) is None)
        return ObjectivePlan(preference_lines(plan, reference), reference if held else None, "reference",
                             preference_memory(plan), preference_passes(plan, None if held else reference))
    return None
