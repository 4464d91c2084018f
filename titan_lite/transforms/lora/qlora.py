"""QLoRA (lora.base_dtype = "nf4"): every frozen block linear stored as NF4, the adapted module's forward through
torchao's NF4 linear, the quantization after load (after PiSSA's SVD: QPiSSA), the refusals and the plan figures."""

import re

import torch
import torch.nn.functional as F
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.dtensor import copy_into_shard, full_tensor
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parameters import canonical_name
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms.base import PlanContext, PlanItem
from titan_lite.transforms.lora.module import LoRALinear, _like, dora_magnitude
from titan_lite.transforms.lora.options import projection_dims, projection_parent
from titan_lite.transforms.nf4 import (
    dequantize,
    is_nf4,
    nf4_bytes_per_element,
    nf4_divisibility_problem,
    quantize_param,
)
from titan_lite.transforms.nf4.fsdp import fsdp_records, swap_parameter
from titan_lite.transforms.nf4.quantize import quantize_local

NF4 = "nf4"
BLOCK_LINEAR = re.compile(r"^layers\.\d+\.(attention\.(w[qkvo]|in_proj_(qkv|z|b|a)|out_proj|q_a_proj|q_b_proj|"
                          r"kv_a_proj_with_mqa|kv_b_proj)|(feed_forward|moe\.shared_experts?)\.w[123])\.weight$")


class NF4LoRALinear(LoRALinear):
    """A LoRALinear whose frozen weight may be NF4: the base product through torchao's NF4 linear (it keeps the
    4-bit weight for backward and dequantizes it there, one weight at a time), the adapter through autograd."""

    def unbiased_forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_nf4(self.weight) or self.adapters_off:
            return super().unbiased_forward(x)
        dropped = self.dropout(x)
        base = F.linear(x, self.weight)  # NF4's __torch_function__: torchao's LinearNF4
        update = F.linear(F.linear(dropped, _like(self.lora_a, x)), _like(self.lora_b, x))
        if self.magnitude is None:
            return base + self.scale * update
        gain = _like(self.magnitude, x) / self.weight_norm().to(base.dtype).detach()
        if not (self.training and isinstance(self.dropout, nn.Dropout)):
            return gain * (base + self.scale * update)
        return base + (gain - 1) * F.linear(dropped, self.weight) + gain * self.scale * update

    def _base_product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if is_nf4(self.weight) else super()._base_product(x)

    def weight_norm(self) -> torch.Tensor:
        """Row norms of the dequantized W + scale B A in float32."""
        if not is_nf4(self.weight):
            return super().weight_norm()
        adapted = dequantize(self.weight) + self.scale * (self.lora_b.float() @ self.lora_a.float())
        return torch.linalg.vector_norm(adapted, dim=1)


def is_block_linear(name: str) -> bool:
    """A transformer block's projection weight (canonical name)."""
    return bool(BLOCK_LINEAR.match(name))


def block_linear_shapes(args: LlamaArgs) -> dict[str, tuple[int, int]]:
    """Canonical weight name -> (out, in) of every block projection (an MoE layer's experts are grouped weights,
    not block linears)."""
    return {f"layers.{i}.{projection_parent(args, i, short)}.{short}.weight": (fan_out, fan_in)
            for i in range(args.n_layers) for short, (fan_in, fan_out) in projection_dims(args, i).items()}


def check_nf4(cfg: JobConfig, args: LlamaArgs, dims: ParallelDims, frozen: list[str]) -> None:
    """Refusals of an NF4 base before launch, each one line."""
    try:
        # torchao is a runtime dependency, but only NF4 needs it: checked here so a broken install is one line
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"'lora.base_dtype' = 'nf4' needs torchao's NF4 tensor, which does not import ({exc}); "
                          "install torchao>=0.18,<0.19") from None
    if dims.tp_enabled:
        raise ConfigError("'lora.base_dtype' = 'nf4' does not support tensor parallelism: torchao's NF4 tensor has no "
                          "DTensor matmul (its mm treats a transposed shard as untransposed), so a TP-sharded 4-bit "
                          "weight cannot be multiplied on its own rank; use FSDP/HSDP, PP or CP, or a bfloat16 base")
    shards = dims.dp_shard * dims.cp
    shapes = block_linear_shapes(args)
    for name in frozen:
        problem = nf4_divisibility_problem(name, *shapes[name], shards)
        if problem is not None:
            raise ConfigError(f"'lora.base_dtype' = 'nf4': {problem}; choose another data_parallel_shard_degree x "
                              f"context_parallel_degree (now {shards}) or base_dtype")


@torch.no_grad()
def quantize_frozen_linears(model_parts: list[nn.Module], frozen: set[str]) -> int:
    """Replace every frozen block linear weight this rank holds by NF4 of its own shard (FSDP then gathers the
    4-bit codes). Returns the number of tensors quantized."""
    records = fsdp_records(model_parts)
    count = 0
    for part in model_parts:
        for module_name, module in part.named_modules():
            weight = getattr(module, "weight", None)
            name = canonical_name(f"{module_name}.weight")
            if name in frozen and isinstance(weight, nn.Parameter) and not is_nf4(weight):
                swap_parameter(module, "weight", quantize_param(weight), records)
                count += 1
    return count


@torch.no_grad()
def init_dora_magnitudes_nf4(modules: list[tuple[str, nn.Module]]) -> None:
    """DoRA's magnitude from the dequantized NF4 weights: the row norms of NF4(W) + scale B A, so DoRA starts as
    the quantized base it trains on."""
    for _, module in modules:
        norms = dora_magnitude(full_tensor(dequantize(module.weight)), full_tensor(module.lora_a),
                               full_tensor(module.lora_b), module.scale)
        copy_into_shard(module.magnitude, norms.to(module.magnitude.dtype))


def dense_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every NF4 tensor dequantized to float32 (an export gathers NF4 weights as they are)."""
    return {n: dequantize(t) if is_nf4(t) else t for n, t in state_dict.items()}


def checksum_tensors(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The plain tensors a bitwise fingerprint reads: an NF4 weight's codes, scales and factors."""
    out = []
    for p in params:
        if is_nf4(p):
            local = p._local_tensor if hasattr(p, "_local_tensor") else p
            out += [local.quantized_data, local.quantized_scalers, local.quantization_factor]
        else:
            out.append(p)
    return out


def nf4_round_trip(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """(the state dict with every block projection quantized to NF4 and dequantized to float32, how many): the base
    a QLoRA run trained on, when its training.dtype was the dtype of these tensors."""
    out, count = dict(state_dict), 0
    for name, tensor in state_dict.items():
        if is_block_linear(name):
            out[name] = dequantize(quantize_local(tensor, [], tensor.numel()))
            count += 1
    return out, count


# ------------------------------------------------------------------------------------------ the plan


def nf4_param_bytes(name: str, param: torch.Tensor, frozen: set[str]) -> float | None:
    """Bytes per element of a frozen block linear in NF4 (its scale factors in the dtype it is loaded in)."""
    if name not in frozen:
        return None
    return nf4_bytes_per_element(param.numel(), param.element_size())


def dequantize_memory(ctx: PlanContext, frozen: set[str]) -> list[PlanItem]:
    """The dequantization of the largest NF4 weight during its matmul (forward, and again in backward): torchao
    widens the two 4-bit codes of each byte to int64 indices (8 bytes per element), looks them up and scales them
    in the stored dtype (two halves each, a flattened copy of the scales, the interleaved result: about 3.5 x the
    stored dtype), then casts to the compute dtype when it differs."""
    sizes = [(p.numel(), p.element_size()) for part in ctx.model_parts for n, p in part.named_parameters()
             if canonical_name(n) in frozen]  # FSDP gathers the whole weight (TP is refused with NF4)
    if not sizes:
        return []
    numel, stored = max(sizes)
    cast = ctx.compute_bytes if ctx.compute_bytes != stored else 0
    nbytes = int(numel * (8 + 3.5 * stored + cast))
    return [PlanItem("buffers", nbytes, f"NF4 dequantization of one weight ({numel:,} elements)")]


def plan_line(args: LlamaArgs, frozen: set[str], factor_bytes: int) -> str:
    """DRY_RUN's summary line of the NF4 base."""
    shapes = block_linear_shapes(args)
    numel = sum(shapes[n][0] * shapes[n][1] for n in frozen)
    nf4_bytes = sum(shapes[n][0] * shapes[n][1] * nf4_bytes_per_element(shapes[n][0] * shapes[n][1], factor_bytes)
                    for n in frozen)
    gib = 1024**3
    return (f"lora: NF4 base (QLoRA): {len(frozen)} frozen block linears, {numel:,} parameters in "
            f"{nf4_bytes / gib:.2f} GiB (4-bit codes + int8 block scales + factors) instead of "
            f"{numel * 2 / gib:.2f} GiB in bfloat16; quantized after load on each rank's shard, never saved")
