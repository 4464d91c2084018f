"""float8 for the frozen base of a module that is not an nn.Linear (a LoRA adapter's): a float8 matmul of (x, W)."""

import torch
from torch import nn


class Float8BaseLinear:
    """x W^T computed by torchao's Float8Linear with W passed at each call (the module's current parameter, sharded
    or not), so nothing here holds a weight: a template Float8Linear on the meta device gives the config."""

    def __init__(self, in_features: int, out_features: int, config):
        # lazy: torchao loads only when float8 is used
        from torchao.float8.float8_linear import Float8Linear

        with torch.device("meta"):
            self.template = Float8Linear(in_features, out_features, bias=False, config=config)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.template, {"weight": weight}, (x,))


def takes_base_linear(module: nn.Module) -> bool:
    """A module whose base product W x a transform may replace (it declares a `base_linear` attribute)."""
    return hasattr(type(module), "base_linear") and hasattr(module, "weight")
