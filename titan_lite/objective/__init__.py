"""What training minimises: the contract every objective keeps (base.py: the Objective, the cross entropy of
titan_lite.loss), distillation from a frozen teacher (distill.py, with its chunked loss in kd.py), preference tuning
on pairs (preference.py, its losses in preference_loss.py, the chunked log-probabilities in logps.py, a precomputed
reference in reference_pass.py, its DRY_RUN share in preference_plan.py) or GRPO on RL rollouts (grpo.py, its
DRY_RUN share in grpo_plan.py); the frozen models they hold (frozen.py, chosen by the one reference helper of
reference.py), vocab-sharded logits (vocab.py) and the one chooser (choose.py)."""

from titan_lite.objective.base import Objective
from titan_lite.objective.choose import (
    ObjectivePlan,
    TrainingObjective,
    build_objective,
    check_objective,
    objective_files_problem,
    plan_objective,
)
from titan_lite.objective.distill import DistillObjective
from titan_lite.objective.grpo import GRPOObjective
from titan_lite.objective.preference import PreferenceObjective

__all__ = ["DistillObjective", "GRPOObjective", "Objective", "ObjectivePlan", "PreferenceObjective",
           "TrainingObjective", "build_objective", "check_objective", "objective_files_problem", "plan_objective"]
