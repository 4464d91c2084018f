"""Model transforms ("converters"): the protocol, the registry, and the built-in transforms."""

from titan_lite.transforms.base import Transform, build_transforms, register_transform

__all__ = ["Transform", "build_transforms", "register_transform"]
