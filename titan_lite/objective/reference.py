"""The frozen model an objective compares the trained one with (distillation's teacher, preference tuning's and
GRPO's reference), one helper for all three: none, the trained model's own base ('base': its adapters switched
off), or a folder; its check before launch, DRY_RUN's checklist line and plan, and its loading."""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from titan_lite.distributed import device_type
from titan_lite.job.assembly import BuiltModel
from titan_lite.job.plan import JobPlan
from titan_lite.objective.frozen import (
    FrozenForward,
    FrozenSpec,
    assemble_frozen,
    base_forward,
    check_frozen,
    frozen_files_problem,
    frozen_plan,
    separate_forward,
)

BASE = "base"
PATH = "path"


@dataclass(frozen=True)
class Reference:
    """Which frozen model: `kind` None (none), BASE (the trained model's base) or PATH (spec.path's model)."""

    kind: str | None
    spec: FrozenSpec

    @classmethod
    def of(cls, spec: FrozenSpec, used: bool = True) -> "Reference":
        """spec.path's reference ('base' or a folder), or none when the objective does not use one."""
        return cls((BASE if spec.path == BASE else PATH) if used else None, spec)

    def check(self, plan: JobPlan, check_base: Callable[[JobPlan], None]) -> None:
        """Before launch: the base's conditions (check_base), or the folder's files, shapes, vocabulary, tokenizer."""
        if self.kind == BASE:
            check_base(plan)
        elif self.kind == PATH:
            check_frozen(plan, self.spec, device_type())

    def files_problem(self, cfg) -> str | None:
        """DRY_RUN's checklist line for a folder not downloaded yet, or None."""
        return frozen_files_problem(cfg, self.spec) if self.kind == PATH else None

    def dry_run_plan(self, plan: JobPlan, files_there: bool) -> JobPlan | None:
        """A folder's plan (from its flavor when its files are not there yet), else None."""
        if self.kind != PATH:
            return None
        return frozen_plan(plan if files_there else replace(plan, tokenizer=None), self.spec,
                           plan.cfg.dry_run.device_type)

    def load(self, plan: JobPlan, model: BuiltModel, device: torch.device, seed: int) -> FrozenForward | None:
        """Its forward: the trained model's base, or the folder's model assembled on the trained one's mesh (loaded,
        frozen); None without a reference."""
        if self.kind == BASE:
            return base_forward(plan, model)
        if self.kind == PATH:
            return separate_forward(*assemble_frozen(plan, self.spec, device, seed))
        return None
