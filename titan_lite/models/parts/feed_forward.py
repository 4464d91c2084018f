"""The dense feed-forward: a gated linear unit (feed_forward.w1 gate, w3 up, w2 down), SwiGLU or Gemma's GeGLU."""

import torch
import torch.nn.functional as F
from torch import nn

# the gate's activation by its LlamaArgs name (ffn_activation)
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x): SwiGLU (silu) or GeGLU (gelu_tanh, the tanh approximation)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.activation = activation
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))

    def extra_repr(self) -> str:
        return "" if self.activation == "silu" else f"activation={self.activation}"
