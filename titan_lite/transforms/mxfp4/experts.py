"""Grouped experts whose frozen weights are MXFP4: each of w1 / w2 / w3 [E, out, in] held as `<w>_blocks` [E, out,
in / 32, 16] (two e2m1 codes a byte, the low nibble the even element) and `<w>_scales` [E, out, in / 32] (E8M0), both
uint8 and frozen; a projection dequantizes one expert's weight at a time, in the rows' dtype, for its matmul, and again
in backward for the input's gradient, so no dequantized copy outlives its expert's product."""

import torch
from torch import nn

from titan_lite.dtensor import local_tensor
from titan_lite.models.hf.mxfp4 import BLOCK, dequantize_rows

WEIGHTS = ("w1", "w2", "w3")
PACKED = ("_blocks", "_scales")
# The packed tensors' names, which the loader leaves to load_packed_experts (a folder holds them under HF names).
NOT_IN_HF = r"\.moe\.experts\.w[123]_(blocks|scales)$"
def packed_names(weight: str) -> tuple[str, str]:
    """The (blocks, scales) parameter names standing for grouped weight `weight` (w1, w2 or w3)."""
    return weight + PACKED[0], weight + PACKED[1]


class _DequantizedGroupedMM(torch.autograd.Function):
    """Rows grouped by expert (counts[e] consecutive rows each) times their expert's dequantized weight, transposed:
    [tokens, out]. Backward recomputes each expert's weight for the input's gradient; the frozen codes get none."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.save_for_backward(blocks, scales)
        ctx.counts = counts
        return _per_expert(x, blocks, scales, counts, transpose=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        blocks, scales = ctx.saved_tensors
        return _per_expert(grad, blocks, scales, ctx.counts, transpose=False), None, None, None


def _per_expert(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, counts: list[int],
                transpose: bool) -> torch.Tensor:
    """x's groups of rows times W_e^T (transpose) or W_e; an expert without rows is not dequantized."""
    width = blocks.shape[1] if transpose else blocks.shape[2] * BLOCK
    outs = []
    for rows, expert_blocks, expert_scales in zip(x.split(counts), blocks.unbind(0), scales.unbind(0), strict=True):
        if rows.shape[0] == 0:
            outs.append(rows.new_zeros(0, width))
            continue
        weight = dequantize_rows(expert_blocks, expert_scales, x.dtype)
        outs.append(rows @ (weight.T if transpose else weight))
    return torch.cat(outs)


class MXFP4Projections:
    """A mixin for GroupedExperts (and its adapted subclasses): `project` through the MXFP4 weights, their biases
    as they are. The weights are packed by `pack_experts` after construction."""

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        blocks, scales = (local_tensor(getattr(self, n)) for n in packed_names(name))
        out = _DequantizedGroupedMM.apply(x, blocks, scales, counts.tolist())
        bias = getattr(self, "b" + name[1:])
        if bias is None:
            return out
        return out + local_tensor(bias).repeat_interleave(counts, dim=0, output_size=x.shape[0])

    def param_init(self) -> dict:
        """The packed weights start as zeros (scale 2^0): they are read from the base's folder after init."""
        own = super().param_init() if hasattr(super(), "param_init") else {}
        packed = {n: _fill(127 if n.endswith(PACKED[1]) else 0) for w in WEIGHTS for n in packed_names(w)}
        return {**own, **packed}

    def extra_repr(self) -> str:
        n_experts, hidden, groups, _ = self.w1_blocks.shape
        return f"experts={n_experts}, dim={groups * BLOCK}, hidden={hidden}, MXFP4 base"


def _fill(value: int):
    return lambda tensor, generator: tensor.fill_(value)


def is_packed_experts(module: nn.Module) -> bool:
    return isinstance(module, MXFP4Projections)


def pack_experts(experts: nn.Module) -> None:
    """Replace the experts' w1 / w2 / w3 [E, out, in] by frozen uint8 blocks and scales of the same device (the meta
    device in convert). Each blocks parameter records the weights it stands for (`packed_numel`), for counts."""
    for weight in WEIGHTS:
        n_experts, out, fan_in = getattr(experts, weight).shape
        device = getattr(experts, weight).device
        delattr(experts, weight)
        blocks = nn.Parameter(torch.empty(n_experts, out, fan_in // BLOCK, BLOCK // 2, dtype=torch.uint8,
                                          device=device), requires_grad=False)
        scales = nn.Parameter(torch.empty(n_experts, out, fan_in // BLOCK, dtype=torch.uint8, device=device),
                              requires_grad=False)
        blocks.packed_numel, scales.packed_numel = n_experts * out * fan_in, 0
        for name, param in zip(packed_names(weight), (blocks, scales), strict=True):
            experts.register_parameter(name, param)
