"""gpt-oss's released MXFP4 expert weights: a `<name>_blocks` / `<name>_scales` pair per expert matrix (uint8 e2m1
codes, two to a byte, and an E8M0 exponent per 32 values), their dequantization to the HF tensor they stand for,
and the quantization that makes such a pair from unquantized weights."""

import torch
from torch import Tensor

BLOCKS, SCALES = "_blocks", "_scales"
# config.json's quantization_config of an MXFP4 folder as openai/gpt-oss-20b's names it (only the experts are FP4)
RELEASE_QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
BLOCK = 32  # values per scale
# e2m1 code -> value: codes 0..7 positive, 8..15 the same negated
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantized_names(name: str) -> tuple[str, str]:
    """The (blocks, scales) tensor names standing for an HF tensor `name` in an MXFP4 folder."""
    return name + BLOCKS, name + SCALES


def dequantized_shape(blocks_shape: list[int]) -> list[int]:
    """The HF tensor's shape [E, in, out] of blocks [E, out, in / 32, 16]."""
    experts, out, groups, pairs = blocks_shape
    return [experts, groups * pairs * 2, out]


_PAIRS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _pair_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """byte -> its two e2m1 values (low nibble first): [256, 2] in `dtype`, made once per dtype and device (it is read
    at every use of an MXFP4 base's experts)."""
    key = (dtype, device)
    if key not in _PAIRS:
        values = torch.tensor(FP4_VALUES, dtype=dtype)
        byte = torch.arange(256)
        _PAIRS[key] = torch.stack([values[byte & 0x0F], values[byte >> 4]], dim=-1).to(device)
    return _PAIRS[key]


def decode_codes(blocks: Tensor, dtype: torch.dtype) -> Tensor:
    """uint8 blocks [..., G, 16] -> e2m1 values [..., G, 32] (a byte's low nibble the even element, high the odd)."""
    codes = blocks.to(torch.uint8).reshape(-1).to(torch.int32)
    values = torch.index_select(_pair_table(dtype, blocks.device), 0, codes)
    return values.view(*blocks.shape[:-1], blocks.shape[-1] * 2)


def dequantize_rows(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """blocks [..., out, G, 16], scales [..., out, G] -> the weight rows [..., out, G * 32]: each 32-value block times
    2^(scale - 127). Exact in bf16 (an e2m1 value has two significant bits)."""
    values = decode_codes(blocks, dtype)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The HF expert tensor [E, in, out] (gate_up_proj [E, dim, 2 hidden], down_proj [E, hidden, dim]) of its MXFP4
    pair, as transformers' dequantizing load gives it."""
    return dequantize_rows(blocks, scales, dtype).transpose(1, 2).contiguous()


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """An HF expert tensor [E, in, out] (in a multiple of 32) -> its MXFP4 (blocks, scales) as the release stores them:
    per 32 values the exponent that brings the largest magnitude within 6, each value rounded to the nearest e2m1."""
    rows = weight.transpose(1, 2).float()
    rows = rows.reshape(*rows.shape[:-1], rows.shape[-1] // BLOCK, BLOCK)
    amax = rows.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = rows / torch.exp2(exponent)
    magnitudes = torch.tensor(FP4_VALUES[:8], device=weight.device)
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def quantization_method(cfg: dict) -> str | None:
    """config.json's quantization_config's quant_method, or None without one."""
    quantization = cfg.get("quantization_config") or {}
    return quantization.get("quant_method", repr(quantization)) if quantization else None


def is_quantized_name(name: str) -> bool:
    """An HF folder's MXFP4 tensor name (model.layers.{i}.mlp.experts.<weight>_blocks / _scales)."""
    return name.startswith("model.layers.") and name.endswith((BLOCKS, SCALES))


def held_name(name: str) -> str:
    """The HF tensor an MXFP4 tensor stands for: its name without _blocks / _scales."""
    return name.removesuffix(BLOCKS).removesuffix(SCALES)
