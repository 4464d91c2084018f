"""NF4 (4-bit NormalFloat, torchao's tensor) storage for frozen weights: each rank quantizes its own shard with the
scale mean of the whole tensor, FSDP2 gathers the 4-bit codes, and the plan counts 4 bits plus scales."""

from titan_lite.transforms.nf4.quantize import (
    BLOCK,
    GROUP,
    SCALER_BLOCK,
    dequantize,
    is_nf4,
    nf4_bytes_per_element,
    nf4_divisibility_problem,
    quantize_param,
)

__all__ = ["BLOCK", "GROUP", "SCALER_BLOCK", "dequantize", "is_nf4", "nf4_bytes_per_element",
           "nf4_divisibility_problem", "quantize_param"]
