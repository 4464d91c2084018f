"""The transform protocol and registry: named objects whose hooks the trainer calls in the configured order."""

from typing import Callable

import torch
from torch import nn

from titan_lite.errors import ConfigError


class Transform:
    """A model transform. Override only the hooks you need; each default does nothing."""

    name: str = ""

    def convert(self, model: nn.Module) -> None:
        """Rewrite the meta-device model before parallelism (e.g. wrap linears, add masks)."""

    def after_load(self, model_parts: list[nn.Module], ctx: dict) -> None:
        """Work that needs real weights or data (ctx holds tokenizer, device, parallel_dims, cfg)."""

    def param_groups(self, model_parts: list[nn.Module]) -> list[dict]:
        """Extra optimizer param groups with their own hyper-parameters."""
        return []

    def after_optimizer_step(self, model_parts: list[nn.Module]) -> None:
        """Run after every optimizer step (e.g. re-apply masks)."""


_REGISTRY: dict[str, Callable[..., Transform]] = {}


def register_transform(name: str) -> Callable:
    def wrap(factory: Callable[..., Transform]) -> Callable[..., Transform]:
        _REGISTRY[name] = factory
        return factory
    return wrap


def build_transforms(names: list[str], cfg) -> list[Transform]:
    """Instantiate the configured transforms, in order; an unknown name is one clear error."""
    transforms = []
    for name in names:
        if name not in _REGISTRY:
            known = ", ".join(sorted(_REGISTRY)) or "none yet"
            raise ConfigError(f"'model.converters' has unknown transform '{name}'; available: {known}")
        transforms.append(_REGISTRY[name](cfg))
    return transforms


@torch.no_grad()
def run_after_step(transforms: list[Transform], model_parts: list[nn.Module]) -> None:
    for t in transforms:
        t.after_optimizer_step(model_parts)
