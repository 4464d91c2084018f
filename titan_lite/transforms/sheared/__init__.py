"""Sheared-LLaMA targeted structured pruning as the 'sheared' transform ([sheared])."""

from titan_lite.transforms.sheared.transform import ShearedTransform

__all__ = ["ShearedTransform"]
