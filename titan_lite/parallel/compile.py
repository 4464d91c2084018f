"""torch.compile of each transformer block (applied after activation checkpointing and before FSDP)."""

import torch
from torch import nn

from titan_lite.config.schema import Compile


def apply_compile(model: nn.Module, compile_cfg: Compile) -> None:
    """Compile every block of model.layers as one full graph; blocks share code, so they share compiled graphs.

    The block is wrapped (not compiled in place) so that FSDP's hooks on the wrapper stay outside the graph.
    """
    for name, block in list(model.layers.named_children()):
        compiled = torch.compile(block, backend=compile_cfg.backend, fullgraph=True)
        model.layers.register_module(name, compiled)


def compiles_model(compile_cfg: Compile) -> bool:
    return compile_cfg.enable and "model" in compile_cfg.components
