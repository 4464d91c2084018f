"""LoRALinear (a frozen weight with a low-rank adapter beside it: LoRA, rsLoRA, DoRA) and the adapter algebra:
scales, merging, PiSSA's principal factors, balanced re-factoring."""

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_lite.transforms.lora.sparse import masked_forward, masked_update

# Parameter names of a LoRALinear. The base keeps the name `weight`, so HF loading and base checkpoints are
# unchanged; the first three train, the pissa_* copies of the initial factors are frozen (the PiSSA export needs them).
ADAPTER_PARAMS = ("lora_a", "lora_b", "magnitude")
PISSA_INIT_PARAMS = ("pissa_a0", "pissa_b0")


def adapter_scale(rank: int, alpha: float, rslora: bool) -> float:
    """alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def kaiming_uniform_a(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A as nn.Linear initialises its weight (and PEFT its lora_A): uniform within 1 / sqrt(fan_in)."""
    return nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)


def gaussian_a(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """PEFT's "gaussian": A ~ N(0, std 1 / rank)."""
    return nn.init.normal_(tensor, 0.0, 1.0 / tensor.shape[0], generator=generator)


def _zeros(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return tensor.zero_()


def _ones(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return tensor.fill_(1.0)


class LoRALinear(nn.Module):
    """y = W x + scale * B A dropout(x), W frozen; with DoRA, y = m / ||W + scale B A||_row * (W + scale B A) x
    (the norm detached, as in the DoRA paper and PEFT).

    `weight` [out, in] keeps nn.Linear's name; `lora_a` [rank, in], `lora_b` [out, rank] and DoRA's `magnitude`
    [out] sit beside it as parameters of this module (so tensor parallelism can place each one). PiSSA's initial
    factors are kept as frozen `pissa_a0` / `pissa_b0` when `keep_init` is set. A biased linear (Qwen2's q/k/v) keeps
    its frozen `bias` [out], added after everything else: DoRA rescales W x + s B A x, not the bias, as PEFT does.
    """

    # Another transform may compute the base product W x its own way (a float8 matmul, say): fn(x, W) -> x W^T.
    base_linear = None

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float, dropout: float = 0.0,
                 dora: bool = False, init: str = "default", keep_init: bool = False, keep_sparsity: bool = False,
                 bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank, self.scale, self.init = (
            in_features, out_features, rank, scale, init)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.magnitude = nn.Parameter(torch.empty(out_features)) if dora else None
        if keep_init:
            self.pissa_a0 = nn.Parameter(torch.empty(rank, in_features), requires_grad=False)
            self.pissa_b0 = nn.Parameter(torch.empty(out_features, rank), requires_grad=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # lora.keep_sparsity: the update is masked by the base's zeros (see sparse.py)
        self.keep_sparsity = keep_sparsity
        self.adapters_off = False  # set by adapters_off(): the module computes its base function
        self.folded = False  # set by fold.folded(): `weight` holds the adapted weight, decoding multiplies it alone

    @property
    def dora(self) -> bool:
        return self.magnitude is not None

    def param_init(self) -> dict:
        """Per-parameter init (Llama.init_weights seeds each by name). B starts at zero, so the adapted model starts
        as the base; PiSSA and DoRA's magnitude are set from the loaded weights later (the transform's after_load)."""
        init_a = gaussian_a if self.init == "gaussian" else kaiming_uniform_a
        return {"lora_a": init_a, "lora_b": _zeros, "magnitude": _ones, "pissa_a0": _zeros, "pissa_b0": _zeros}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_bias(self.unbiased_forward(x))

    def with_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + _like(self.bias, y)

    def unbiased_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.folded:
            return self._base_product(x)
        if self.adapters_off:
            return self.base_forward(x)
        weight = _like(self.weight, x)
        dropped = self.dropout(x)
        if self.keep_sparsity:
            return self._masked_forward(x, weight, dropped)
        if self.magnitude is None and not isinstance(weight, DTensor) and self.base_linear is None:
            return self._plain_forward(x, weight, dropped)
        base = self._base(x, weight)
        update = F.linear(F.linear(dropped, _like(self.lora_a, x)), _like(self.lora_b, x))
        if self.magnitude is None:
            return base + self.scale * update
        gain = (_like(self.magnitude, x) / self.weight_norm().to(base.dtype).detach())
        if not (self.training and isinstance(self.dropout, nn.Dropout)):
            return gain * (base + self.scale * update)
        # With dropout the magnitude rescales the dropped input's base product, as PEFT does.
        return base + (gain - 1) * self._base(dropped, weight) + gain * self.scale * update

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The function the module was loaded with, without the adapter: W x; PiSSA's W is the residual, so its
        initial factors are added back (s B0 A0 x), which gives the original weight's product."""
        out = self._base_product(x)
        if hasattr(self, "pissa_a0"):
            out = out + self.scale * F.linear(F.linear(x, _like(self.pissa_a0, x)), _like(self.pissa_b0, x))
        return out

    def _base_product(self, x: torch.Tensor) -> torch.Tensor:
        return self._base(x, _like(self.weight, x))

    def _base(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) if self.base_linear is None else self.base_linear(x, weight)

    def _masked_forward(self, x: torch.Tensor, weight: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        dropout_active = self.training and isinstance(self.dropout, nn.Dropout)
        magnitude = None if self.magnitude is None else _like(self.magnitude, x)
        norm = None if magnitude is None else self.weight_norm().to(x.dtype)
        return masked_forward(x, dropped if dropout_active else x, weight, _like(self.lora_a, x),
                              _like(self.lora_b, x), self.scale, magnitude, norm, self.base_linear)

    def _plain_forward(self, x: torch.Tensor, weight: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        """W x + scale B (A x) with the update accumulated into W x by one GEMM (addmm_, alpha = scale): no
        [tokens, out] temporaries for the scaled update and the sum, and none for the scaled gradient in the
        backward (the scale rides in the small GEMMs there). Eager outside autocast, one autograd node does it all."""
        lora_a, lora_b = _like(self.lora_a, x), _like(self.lora_b, x)
        if not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling():
            return _LoRAProduct.apply(x, None if dropped is x else dropped, weight, lora_a, lora_b, self.scale)
        base = F.linear(x.flatten(0, -2), weight)
        down = F.linear(dropped.flatten(0, -2), lora_a)
        # Under autocast the two products may come out in a dtype other than the fp32 parameters'.
        base.addmm_(down.to(base.dtype), lora_b.to(base.dtype).t(), alpha=self.scale)
        return base.view(*x.shape[:-1], self.out_features)

    def weight_norm(self) -> torch.Tensor:
        """Row norms of W + scale B A in float32 (the update masked with keep_sparsity)."""
        adapted = merged_weight(self.weight, self.lora_a, self.lora_b, self.scale, keep_sparsity=self.keep_sparsity)
        return torch.linalg.vector_norm(adapted, dim=1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"scale={self.scale:.6g}, dora={self.dora}" + (", keep_sparsity=True" if self.keep_sparsity else ""))


@contextlib.contextmanager
def adapters_off(modules: list[LoRALinear]) -> Iterator[None]:
    """Within it the modules compute their base function (distillation's self-teacher); restored on exit."""
    for module in modules:
        module.adapters_off = True
    try:
        yield
    finally:
        for module in modules:
            module.adapters_off = False


class _LoRAProduct(torch.autograd.Function):
    """y = x W^T + scale (d A^T) B^T with d = dropout(x) (None: d is x), tensors of one dtype.

    One node instead of autograd's five (two linears, addmm_, views): the backward accumulates the adapter's input
    gradient into x's by one addmm_ (no [tokens, in] sum of two gradients) and runs each small GEMM once.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dropped: torch.Tensor | None, weight: torch.Tensor, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        dropped_rows = rows if dropped is None else dropped.reshape(rows.shape)
        down = dropped_rows @ lora_a.t()
        out = (rows @ weight.t()).addmm_(down, lora_b.t(), alpha=scale)
        ctx.save_for_backward(rows if ctx.needs_input_grad[2] else None, dropped_rows, weight, lora_a, lora_b, down)
        ctx.scale, ctx.x_shape, ctx.separate_dropped = scale, x.shape, dropped is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, dropped_rows, weight, lora_a, lora_b, down = ctx.saved_tensors
        need_x, need_dropped, need_w, need_a, need_b, _ = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_down = (grad_rows @ lora_b).mul_(ctx.scale)  # [tokens, rank]
        grad_a = grad_down.t() @ dropped_rows if need_a else None
        grad_b = (grad_rows.t() @ down).mul_(ctx.scale) if need_b else None
        grad_w = grad_rows.t() @ rows if need_w else None
        grad_x = grad_rows @ weight if need_x else None
        grad_dropped = None
        if ctx.separate_dropped and need_dropped:
            grad_dropped = (grad_down @ lora_a).view(ctx.x_shape)
        elif not ctx.separate_dropped and need_x:
            grad_x.addmm_(grad_down, lora_a)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_dropped, grad_w, grad_a, grad_b, None


def _like(param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The parameter in the input's dtype: a bf16 frozen base meets fp32 activations when nothing casts (no FSDP
    mixed precision, no autocast); under autocast the matmul casts both itself."""
    if param.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return param
    return param.to(x.dtype)


# ------------------------------------------------------------------------------------------ algebra


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                  magnitude: torch.Tensor | None = None, keep_sparsity: bool = False) -> torch.Tensor:
    """The plain weight an adapter amounts to (float32): W + scale B A, with DoRA rescaled per output row to m;
    keep_sparsity: the update only where W is nonzero (W's zeros stay exactly zero, DoRA's rescaling too)."""
    if keep_sparsity:
        adapted = weight.float() + masked_update(weight, lora_a.float(), lora_b.float(), scale)
    else:
        adapted = weight.float() + scale * (lora_b.float() @ lora_a.float())
    if magnitude is None:
        return adapted
    return adapted * (magnitude.float() / torch.linalg.vector_norm(adapted, dim=1))[:, None]


def dora_magnitude(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """DoRA's initial magnitude: the row norms of W + scale B A, so the converted layer starts as the base."""
    return torch.linalg.vector_norm(weight.float() + scale * (lora_b.float() @ lora_a.float()), dim=1)


def randomized_svd(m: torch.Tensor, rank: int, niter: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank-`rank` SVD by random projection with `niter` subspace iterations (Halko et al., as torch.svd_lowrank
    without oversampling), from a seeded generator: the same inputs give the same factors."""
    omega = torch.randn(m.shape[1], rank, generator=generator, device=m.device, dtype=m.dtype)
    q = torch.linalg.qr(m @ omega).Q
    for _ in range(niter):
        q = torch.linalg.qr(m.T @ q).Q
        q = torch.linalg.qr(m @ q).Q
    u, s, vh = torch.linalg.svd(q.T @ m, full_matrices=False)
    return q @ u, s, vh


def principal_factors(weight: torch.Tensor, rank: int, scale: float, niter: int | None = None,
                      generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PiSSA's (A, B) of a weight, in float32: the top singular triplets U_r S_r V_r^T split as
    B = U_r sqrt(S_r / scale), A = sqrt(S_r / scale) V_r^T, so scale B A is the rank-r truncation of W.
    niter None: exact SVD; else a seeded randomized SVD."""
    w = weight.float()
    if niter is None:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        u, s, vh = u[:, :rank], s[:rank], vh[:rank]
    else:
        u, s, vh = randomized_svd(w, rank, niter, generator)
    root = (s / scale).sqrt()
    return (root[:, None] * vh).contiguous(), (u * root).contiguous()


def balanced_factors(lora_a: torch.Tensor, lora_b: torch.Tensor,
                     max_singular_value: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A', B') with B' A' = B A and equal singular values in both (B' = U sqrt(S), A' = sqrt(S) V^T), through QR of
    each factor and the SVD of the small core; optionally clamping the product's singular values."""
    qb, rb = torch.linalg.qr(lora_b.float())
    qa, ra = torch.linalg.qr(lora_a.float().T)
    u, s, vh = torch.linalg.svd(rb @ ra.T)
    if max_singular_value is not None:
        s = s.clamp(max=max_singular_value)
    root = s.sqrt()
    return root[:, None] * (vh @ qa.T), (qb @ u) * root
