"""Parameter names and their initialisation: canonical_name (without wrapper prefixes) and init_parameter
(torchtitan's init, chosen by the parameter's name)."""

import math

import torch
from torch import nn

from titan_lite.models.args import LlamaArgs

_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def weight_count(param: torch.Tensor) -> int:
    """The model weights a parameter holds: its elements, or what a transform's packed parameter records standing
    for (`packed_numel`: codes packed two to a byte count double, their scales nothing)."""
    return getattr(param, "packed_numel", param.numel())


def canonical_name(name: str) -> str:
    """A parameter name without compile/checkpoint wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def init_parameter(name: str, tensor: torch.Tensor, args: LlamaArgs, generator: torch.Generator) -> None:
    """torchtitan-style init: unit-normal embeddings, std 0.02 projections scaled down with depth on the
    residual outputs, dim^-0.5 output head, ones for norms (zeros for the (1 + w) norms); the Gated DeltaNet's decay
    as transformers draws it (dt_bias 1, A_log = log U(0.01, 16)) and its conv at std kernel^-1/2."""
    if name.endswith("norm.weight"):
        unit_offset = args.norm_unit_offset and not name.endswith("attention.norm.weight")  # the gated norm is plain
        tensor.fill_(0.0 if unit_offset else 1.0)
        return
    if name.endswith("dt_bias"):
        tensor.fill_(1.0)
        return
    if name.endswith("A_log"):
        tensor.uniform_(0.01, 16.0, generator=generator).log_()
        return
    if name.endswith("conv1d.weight"):
        nn.init.normal_(tensor, 0.0, tensor.shape[-1] ** -0.5, generator=generator)
        return
    if name.endswith((".bias", "experts.b1", "experts.b2", "experts.b3", "attention.sinks", "e_score_correction_bias")):
        tensor.zero_()
        return
    if name == "tok_embeddings.weight":
        std = args.dim ** -0.5 if args.tie_word_embeddings else 1.0
        nn.init.normal_(tensor, 0.0, std, generator=generator)
        return
    if name == "output.weight":
        std = args.dim ** -0.5
        nn.init.trunc_normal_(tensor, 0.0, std, -3 * std, 3 * std, generator=generator)
        return
    std = 0.02
    if name.startswith("layers.") and name.endswith(("wo.weight", "w2.weight", "w3.weight", "experts.w2",
                                                     "experts.w3", "out_proj.weight")):
        layer_id = int(name.split(".")[1])
        std = 0.02 / math.sqrt(2 * (layer_id + 1))
    nn.init.trunc_normal_(tensor, 0.0, std, -2 * std, 2 * std, generator=generator)
