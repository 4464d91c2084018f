"""Model transforms ("converters"): the contract, the registry, and the built-in transforms (registered on import)."""

from titan_lite.transforms import float8, lora  # noqa: F401  (register "quantize.linear.float8" and "lora")
from titan_lite.transforms.base import (
    PassPlan,
    PlanContext,
    PlanItem,
    Transform,
    TransformContext,
    Transforms,
    build_transforms,
    register_transform,
    registered_transforms,
)
from titan_lite.transforms.lora.adapters import apply_peft_adapter
from titan_lite.transforms.pruning import PruneTransform
from titan_lite.transforms.sheared import ShearedTransform

__all__ = ["PassPlan", "PlanContext", "PlanItem", "PruneTransform",
           "ShearedTransform", "Transform", "TransformContext", "Transforms", "apply_peft_adapter", "build_transforms",
           "register_transform", "registered_transforms"]
