"""Sparse recovery (`lora.keep_sparsity`): the adapter's update masked by the frozen base's zeros, W + (s B A) * M
with M = (W != 0), in the forward (eager fused and autograd paths), the DoRA norm and the merge; and when it is on."""

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_lite.config.schema import JobConfig
from titan_lite.dtensor import local_tensor
from titan_lite.errors import ConfigError

logger = logging.getLogger("titan_lite")

KEEP_SPARSITY_MODES = ("auto", "on", "off")
# Written into an exported adapter folder trained with masked updates; scripts/merge_lora.py reads it.
MARKER = "titan_lite_sparsity.json"


def keep_sparsity_enabled(cfg: JobConfig) -> bool:
    """`lora.keep_sparsity`: auto is on when the 'prune' transform precedes 'lora' (the base carries its masks);
    on forces it (a base pruned elsewhere: its zeros are the masks); off never masks."""
    mode = cfg.lora.keep_sparsity
    if mode == "auto":
        return "prune" in cfg.model.converters
    return mode == "on"


def check_keep_sparsity(cfg: JobConfig) -> None:
    """Refusals before launch: PiSSA rewrites the base into a dense residual; 'on' needs a base with zeros."""
    if not keep_sparsity_enabled(cfg):
        return
    if cfg.lora.init.startswith("pissa"):
        raise ConfigError(f"'lora.keep_sparsity' = '{cfg.lora.keep_sparsity}' cannot go with 'lora.init' = "
                          f"'{cfg.lora.init}': PiSSA replaces the base with a dense residual, so there is no zero "
                          "pattern to keep; use init 'default' or 'gaussian', or keep_sparsity 'off'")
    if cfg.lora.base_dtype == "nf4":
        raise ConfigError(f"'lora.keep_sparsity' = '{cfg.lora.keep_sparsity}' cannot go with 'lora.base_dtype' = "
                          "'nf4': the 4-bit base's matmul does not take the masked update; use a float32 or bfloat16 "
                          "base, or keep_sparsity 'off'")
    c = cfg.checkpoint
    if "prune" not in cfg.model.converters and not (c.initial_load_path or c.initial_load_in_hf):
        raise ConfigError("'lora.keep_sparsity' = 'on' needs a pruned base: list 'prune' before 'lora' in "
                          "'model.converters', or load pruned initial weights ('checkpoint.initial_load_path', "
                          "'checkpoint.initial_load_in_hf')")


@torch.no_grad()
def check_base_sparsity(modules: list[tuple[str, torch.nn.Module]], mode: str) -> None:
    """Count the zeros of the adapted bases over all ranks (collective) and log them; none at all is one line:
    nothing to keep (a dense base)."""
    counts = torch.zeros(2, dtype=torch.float64)
    for _, module in modules:
        weight = local_tensor(module.weight)
        counts += torch.tensor([float((weight == 0).sum()), float(weight.numel())], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = local_tensor(modules[0][1].weight).device if modules else torch.device("cpu")
        counts = counts.to(device)
        dist.all_reduce(counts)  # replicas count alike: the ratio is unaffected
    zeros, numel = counts.tolist()
    if zeros == 0:
        raise ConfigError(f"'lora.keep_sparsity' = '{mode}' but the adapted weights of the loaded base hold no zeros: "
                          "there are no masks to keep; load a pruned base (or add 'prune' before 'lora' in "
                          "'model.converters'), or set keep_sparsity 'off'")
    logger.info(f"lora: keep_sparsity: each update is masked by its base's zeros ({zeros / numel:.2%} of the "
                "adapted weights); training, merge and export keep them exactly")


def sparsity_marker() -> dict[str, str]:
    """The file (name -> text) that tells scripts/merge_lora.py an adapter folder was trained with masked updates."""
    return {MARKER: json.dumps({"keep_sparsity": True, "rule": "W + (s B A) * (W != 0)"}) + "\n"}


def adapter_keeps_sparsity(folder: str | Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def masked_update(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale (B A) where W is nonzero, 0 where it is zero: W plus this has exactly W's zeros."""
    return (lora_b @ lora_a).mul_(scale) * (weight != 0)


def masked_forward(x: torch.Tensor, dropped: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, scale: float, magnitude: torch.Tensor | None,
                   weight_norm: torch.Tensor | None, base_linear=None) -> torch.Tensor:
    """y = x W^T + d ((s B A) * M)^T with d the dropped input (`dropped is x` without dropout); with DoRA, the
    magnitude over the detached row norm (`weight_norm`, of the masked adapted weight) rescales it as in PEFT.
    `base_linear`: another transform's base product fn(x, W) (float8, say); the masked update is then added apart."""
    plain = magnitude is None and not isinstance(weight, DTensor) and base_linear is None
    if plain and not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling():
        return _MaskedLoRAProduct.apply(x, None if dropped is x else dropped, weight, lora_a, lora_b, scale)
    update = masked_update(weight, lora_a, lora_b, scale)
    if base_linear is None and dropped is x:  # one GEMM with the adapted weight
        adapted = F.linear(x, weight + update)
        return adapted if magnitude is None else magnitude / weight_norm.detach() * adapted
    base = base_linear or F.linear
    if magnitude is None:
        return base(x, weight) + F.linear(dropped, update)
    gain = magnitude / weight_norm.detach()
    if dropped is x:
        return gain * (base(x, weight) + F.linear(x, update))
    return base(x, weight) + (gain - 1) * base(dropped, weight) + gain * F.linear(dropped, update)


class _MaskedLoRAProduct(torch.autograd.Function):
    """y = x W^T + d U^T with U = (s B A) * (W != 0), d = dropout(x) (None: d is x); tensors of one dtype.

    Saves the inputs, not the dense [out, in] update (under FSDP that would keep a full copy of every gathered
    weight alive until the backward): the backward forms U and the mask again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dropped: torch.Tensor | None, weight: torch.Tensor, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        update = masked_update(weight, lora_a, lora_b, scale)
        if dropped is None:
            out = rows @ (update.add_(weight)).t()
        else:
            out = (rows @ weight.t()).addmm_(dropped.reshape(rows.shape), update.t())
        del update
        ctx.save_for_backward(rows, None if dropped is None else dropped.reshape(rows.shape), weight, lora_a, lora_b)
        ctx.scale, ctx.x_shape = scale, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, dropped_rows, weight, lora_a, lora_b = ctx.saved_tensors
        need_x, need_dropped, need_w, need_a, need_b, _ = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        mask = weight != 0
        update = masked_update(weight, lora_a, lora_b, ctx.scale)
        adapter_input = rows if dropped_rows is None else dropped_rows
        grad_x = grad_dropped = grad_w = grad_a = grad_b = None
        if need_x:
            grad_x = grad_rows @ (weight if dropped_rows is not None else weight + update)
        if dropped_rows is not None and need_dropped:
            grad_dropped = (grad_rows @ update).view(ctx.x_shape)
        del update
        if need_w:  # d/dW of the masked update is 0 almost everywhere (the mask is piecewise constant)
            grad_w = grad_rows.t() @ rows
        if need_a or need_b:
            grad_update = (grad_rows.t() @ adapter_input).mul_(mask).mul_(ctx.scale)  # [out, in]
            grad_a = lora_b.t() @ grad_update if need_a else None
            grad_b = grad_update @ lora_a.t() if need_b else None
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_dropped, grad_w, grad_a, grad_b, None
