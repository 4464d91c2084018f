"""A decoder block: pre-norm residuals around the layer's mixer and its feed-forward, dense (feed_forward) or, in
the MoE layers of an MoE model, routed (moe); with sandwich norms (Gemma 3) each output is normed again before its
residual add (post_attention_norm, post_ffn_norm)."""

import torch
from torch import nn

from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.cache import LayerCache
from titan_lite.models.parts.feed_forward import FeedForward
from titan_lite.models.parts.mixers import build_mixer
from titan_lite.models.parts.moe import MoE
from titan_lite.models.parts.norms import make_norm


class TransformerBlock(nn.Module):
    """x + mixer(norm(x)), then h + feed-forward(norm(h)) (sandwich: x + post_norm(mixer(norm(x))), likewise the
    feed-forward); parts chosen by the args' schedule for this layer."""

    def __init__(self, args: LlamaArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = make_norm(args.dim, args)
        self.attention = build_mixer(args, layer_id)
        self.ffn_norm = make_norm(args.dim, args)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim_of(layer_id), args.ffn_activation)
        self.post_attention_norm = make_norm(args.dim, args) if args.sandwich_norms else None
        self.post_ffn_norm = make_norm(args.dim, args) if args.sandwich_norms else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                mask=None) -> torch.Tensor:
        mixed = self.attention(self.attention_norm(x), rope, cache=cache, mask=mask)
        h = x + (mixed if self.post_attention_norm is None else self.post_attention_norm(mixed))
        mlp = self.moe if self.moe_enabled else self.feed_forward
        fed = mlp(self.ffn_norm(h))
        return h + (fed if self.post_ffn_norm is None else self.post_ffn_norm(fed))
