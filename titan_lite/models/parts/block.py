"""A decoder block: pre-norm residuals around the layer's mixer and its feed-forward, dense (feed_forward) or, in
the MoE layers of an MoE model, routed (moe)."""

import torch
from torch import nn

from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.cache import LayerCache
from titan_lite.models.parts.feed_forward import FeedForward
from titan_lite.models.parts.mixers import build_mixer
from titan_lite.models.parts.moe import MoE
from titan_lite.models.parts.norms import make_norm


class TransformerBlock(nn.Module):
    """x + mixer(norm(x)), then h + feed-forward(norm(h)); parts chosen by the args' schedule for this layer."""

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
            self.feed_forward = FeedForward(args.dim, args.ffn_dim_of(layer_id))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache=cache, mask=mask)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return h + mlp(self.ffn_norm(h))
