"""What training minimises: cross entropy (titan_lite.loss), or distillation from a frozen teacher (distill.py, with
its chunked loss in kd.py)."""

from titan_lite.objective.distill import (
    DistillObjective,
    ObjectivePlan,
    build_objective,
    check_objective,
    plan_objective,
    teacher_files_problem,
)

__all__ = ["DistillObjective", "ObjectivePlan", "build_objective", "check_objective", "plan_objective",
           "teacher_files_problem"]
