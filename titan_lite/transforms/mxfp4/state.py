"""The packed experts in a full state dict (an export's, gathered as float32 copies of the uint8 codes): dequantized to
the plain w1 / w2 / w3 a merge or a bfloat16 export needs, or turned back into the release's HF tensors exactly as
they were loaded (gate_up_proj's rows interleaving w1's and w3's)."""

import re

import torch

from titan_lite.models.hf.mxfp4 import dequantize_rows, quantized_names
from titan_lite.transforms.mxfp4.experts import PACKED, WEIGHTS, packed_names
from titan_lite.transforms.mxfp4.load import RELEASED

PACKED_NAME = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])(_blocks|_scales)$")


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.round().to(torch.uint8)


def packed_layers(state: dict[str, torch.Tensor]) -> list[str]:
    """The layers (as strings) whose experts a state dict holds packed."""
    return sorted({m.group(1) for n in state if (m := PACKED_NAME.match(n))}, key=int)


def dense_experts(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict with each layer's packed experts replaced by their dequantized w1 / w2 / w3 [E, out, in]."""
    out = dict(state)
    for layer in packed_layers(state):
        for weight in WEIGHTS:
            blocks, scales = (_codes(out.pop(f"layers.{layer}.moe.experts.{n}")) for n in packed_names(weight))
            out[f"layers.{layer}.moe.experts.{weight}"] = dequantize_rows(blocks, scales, dtype)
    return out


def packed_hf_tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the state dict without its packed experts, the release's HF tensors holding them: *_blocks / *_scales of
    mlp.experts.gate_up_proj and down_proj, uint8, bit for bit as loaded)."""
    rest, hf = dict(state), {}
    for layer in packed_layers(state):
        for name, held in RELEASED.items():
            for index, suffix in enumerate(PACKED):
                parts = [(rows, _codes(rest.pop(f"layers.{layer}.moe.experts.{w}{suffix}"))) for w, rows in held]
                shape = list(parts[0][1].shape)
                shape[1] *= len(parts)
                whole = torch.empty(shape, dtype=torch.uint8)
                for rows, part in parts:
                    whole[:, rows] = part
                hf[quantized_names(f"model.layers.{layer}.{name}")[index]] = whole
    return rest, hf
