"""Grouped experts of a mixture-of-experts layer: E SwiGLU experts held as [E, ...] weights (moe.experts.w1/w2/w3,
gpt-oss's biases b1/b2/b3 and clamped SwiGLU) and the grouped matrix product over rows sorted by expert."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_lite.dtensor import local_tensor


def grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm computes x @ weight[e].T here: on CUDA sm90+ in bfloat16 (elsewhere on CUDA torch
    falls back to a loop with a host sync per expert, pytorch #161407, no faster than ours), and on the CPU (torch
    2.9+) when every row stride is a multiple of 16 bytes, eagerly or in bfloat16 (compiled code checks its inputs
    against the CUDA kernel's bfloat16-only rule); otherwise grouped_mm loops over the experts."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype or isinstance(weight, DTensor):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.device.type != "cpu" or (torch.compiler.is_compiling() and x.dtype != torch.bfloat16):
        return False
    return all(width * x.element_size() % 16 == 0 for width in weight.shape[1:])


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x [tokens, in] grouped by expert (counts [E] consecutive rows each) times their expert's
    weight [E, out, in], transposed: [tokens, out]. One kernel where it runs (grouped_mm_runs), else a loop."""
    if grouped_mm_runs(x, weight):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    groups = x.split(counts.tolist())
    # unbind, not weight[e]: indexing's backward writes a whole [E, out, in] gradient per expert
    return torch.cat([group @ w.T for group, w in zip(groups, weight.unbind(0), strict=True)])


class GroupedExperts(nn.Module):
    """E SwiGLU experts held as grouped weights, torchtitan's layout: w1 (gate) and w3 (up) [E, hidden, dim], w2
    (down) [E, dim, hidden]; expert e of an HF checkpoint is w1[e] = gate_proj, w3[e] = up_proj, w2[e] = down_proj.

    The interface expert parallelism wraps: forward(x, counts) takes the routed tokens x [N, dim] already grouped by
    expert (counts[e] consecutive rows for expert e, e over the experts this module holds) and returns each row's
    expert output [N, dim] in the same order. It knows nothing of routing: EP shards the E dimension of w1/w2/w3 and
    moves the rows to their experts' ranks (all-to-all) before this call and back after it. A transform that adapts
    the experts (LoRA) overrides `project`, which applies one projection to the grouped rows."""

    def __init__(self, dim: int, hidden: int, n_experts: int, activation: str = "swiglu", bias: bool = False,
                 alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        # gpt-oss: a bias per expert on each projection (b1, b3 [E, hidden], b2 [E, dim])
        self.b1 = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.b2 = nn.Parameter(torch.empty(n_experts, dim)) if bias else None
        self.b3 = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.activation, self.alpha, self.limit = activation, alpha, limit

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate, up = self.project("w1", x, counts), self.project("w3", x, counts)
        return self.project("w2", self.activate(gate, up), counts)

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The hidden rows of the gate and up projections: SwiGLU, or gpt-oss's clamped form."""
        if self.activation == "clamped_swiglu":
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return gate * torch.sigmoid(gate * self.alpha) * (up + 1)
        return F.silu(gate) * up

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Projection `name` (w1, w2 or w3) of each group of rows by its expert's weight (and bias, when held)."""
        out = grouped_mm(x, local_tensor(getattr(self, name)), counts)
        bias = getattr(self, "b" + name[1:])
        if bias is None:
            return out
        return out + local_tensor(bias).repeat_interleave(counts, dim=0, output_size=x.shape[0])

    def extra_repr(self) -> str:
        n_experts, hidden, dim = self.w1.shape
        return f"experts={n_experts}, dim={dim}, hidden={hidden}"
