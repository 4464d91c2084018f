"""The mixers a layer may have, by the name config.json's layer_types gives them, and the check of a schedule."""

from collections.abc import Callable

from torch import nn

from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.attention import Attention
from titan_lite.models.parts.gated_deltanet import GatedDeltaNet, check_linear_heads
from titan_lite.models.parts.mla import LatentAttention, check_latent_shapes

# layer type -> the mixer of layer i (held as layers.{i}.attention)
MIXERS: dict[str, Callable[[LlamaArgs, int], nn.Module]] = {
    "full_attention": lambda args, layer: Attention(args, layer),
    "sliding_attention": lambda args, layer: Attention(args, layer, window=args.sliding_window),
    "linear_attention": GatedDeltaNet,
    "latent_attention": LatentAttention,  # DeepSeek-V3's (not a transformers layer type: every layer of its class)
}


def check_layer_types(args: LlamaArgs, source: str = "model args") -> None:
    """A ConfigError in one line where the schedule names an unknown mixer, has another length than n_layers, or
    slides without a window, or has Gated DeltaNet layers whose head counts do not divide, or latent attention layers
whose widths cannot be built."""
    if args.layer_types is not None and len(args.layer_types) != args.n_layers:
        raise ConfigError(f"{source}: 'layer_types' has {len(args.layer_types)} entries; expected one per layer "
                          f"(n_layers = {args.n_layers})")
    for layer, kind in enumerate(args.schedule):
        if kind not in MIXERS:
            raise ConfigError(f"{source}: layer_types[{layer}] is {kind!r}; known layer types: {', '.join(MIXERS)}")
        if kind == "sliding_attention" and args.sliding_window is None:
            raise ConfigError(f"{source}: layer_types[{layer}] is 'sliding_attention' but 'sliding_window' is not "
                              "set; give the window's length")
    if args.is_hybrid:
        check_linear_heads(args, source)
    if args.is_latent:
        check_latent_shapes(args, source)


def build_mixer(args: LlamaArgs, layer: int) -> nn.Module:
    """The mixer the schedule gives layer `layer` (check_layer_types has passed)."""
    return MIXERS[args.layer_type(layer)](args, layer)
