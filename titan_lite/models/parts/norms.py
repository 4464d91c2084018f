"""RMSNorms: nn.RMSNorm's parameter and values (with a leaner autograd function for eager float32 on the CPU), the
(1 + w) form of Qwen3.5 (w starting at 0), the gated form of its Gated DeltaNet output, and the one a model's args
ask for."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter, same values); eager float32 on CPU runs _RMSNormFunction, since torch's CPU
    rms_norm is a composite of five ops whose autograd saves and re-reads more than the few passes below.
    Accelerators have a fused kernel and compiled code fuses the composite itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = not isinstance(x, DTensor) and not isinstance(self.weight, DTensor)
        if plain and x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32 and \
                not torch.compiler.is_compiling():
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return _RMSNormFunction.apply(x, self.weight, eps)
        return super().forward(x)


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row, saving only (x, rstd)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        x_hat = x * rstd
        grad_weight = (grad * x_hat).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        g = grad * weight
        # d/dx of x_hat * w: rstd * (g - x_hat * mean(g * x_hat)) along the row
        row_mean = (g * x_hat).mean(-1, keepdim=True)
        return g.sub_(x_hat.mul_(row_mean)).mul_(rstd), grad_weight, None


class UnitOffsetRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: in float32, x * rsqrt(mean(x^2) + eps) * (1 + w), then cast back; w starts at 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet's output norm over each head: w * norm(o) * silu(z), the norm in float32 cast back to o's
    dtype before w (plain, starting at 1), the gate in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * y * F.silu(gate.float())).to(x.dtype)


def make_norm(dim: int, args) -> nn.Module:
    """The RMSNorm over `dim` the model's args ask for (LlamaArgs: the (1 + w) form where norm_unit_offset)."""
    if args.norm_unit_offset:
        return UnitOffsetRMSNorm(dim, eps=args.norm_eps)
    return RMSNorm(dim, eps=args.norm_eps)
