"""MXFP4 storage for a frozen MoE base (gpt-oss's released experts): the experts' weights held as the release's uint8
blocks and E8M0 scales, dequantized one expert at a time inside the grouped matmul (forward and backward), read from
the folder as they are (or quantized from an unquantized one), written back as they were, and planned."""

from titan_lite.transforms.mxfp4.experts import (
    PACKED,
    WEIGHTS,
    MXFP4Projections,
    is_packed_experts,
    pack_experts,
    packed_names,
)
from titan_lite.transforms.mxfp4.load import load_packed_experts
from titan_lite.transforms.mxfp4.state import dense_experts, packed_hf_tensors

__all__ = ["PACKED", "WEIGHTS", "MXFP4Projections", "dense_experts", "is_packed_experts",
           "load_packed_experts", "pack_experts", "packed_hf_tensors", "packed_names"]
