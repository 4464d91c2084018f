"""torch.compile of each transformer block (applied after activation checkpointing and before FSDP)."""

import torch
from torch import nn

from titan_lite.config.schema import Compile
from titan_lite.models.parts.moe import MoE


def apply_compile(model: nn.Module, compile_cfg: Compile, tp_enabled: bool = False) -> None:
    """Compile every block of model.layers as one full graph (no graph breaks allowed), except MoE blocks: their
    experts loop over data-dependent token counts and their load statistics stay eager, so those break the graph.

    The block is wrapped (not compiled in place) so that FSDP's hooks on the wrapper stay outside the graph.
    """
    for name, block in list(model.layers.named_children()):
        moe = any(isinstance(module, MoE) for module in block.modules())
        compiled = torch.compile(block, backend=compile_cfg.backend, fullgraph=not moe)
        model.layers.register_module(name, compiled)
    if tp_enabled:
        copy_embedding_output(model)


def copy_embedding_output(model: nn.Module) -> None:
    """Under TP the embedding hands the first block a view of a DTensor's local shard. AOTAutograd traces such an
    input back to its base and returns that base a plain-tensor gradient, which DTensor's backward cannot take
    (torch 2.13). A copy of the activation (one per step) cuts the alias."""
    embedding = getattr(model, "tok_embeddings", None)
    if embedding is not None:
        embedding.register_forward_hook(lambda _module, _inputs, out: out.clone() if out._base is not None else out)


def compiles_model(compile_cfg: Compile) -> bool:
    return compile_cfg.enable and "model" in compile_cfg.components
