"""What an MXFP4 base changes in the memory plan: its experts stored (and gathered by FSDP) as one byte of codes per two
weights plus an E8M0 byte per 32 (0.53125 bytes a weight), and one expert's dequantized weight alive during its
matmul, forward and backward."""

from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.mxfp4 import BLOCK
from titan_lite.transforms.base import PlanContext, PlanItem
from titan_lite.transforms.mxfp4.experts import PACKED

BYTES_PER_WEIGHT = 0.5 + 1 / BLOCK  # 4-bit code + one E8M0 scale per 32 values = 0.53125
GIB = 1024**3


def is_packed(name: str) -> bool:
    """A packed expert tensor's canonical name (layers.{i}.moe.experts.w1_blocks, ...)."""
    return ".moe.experts.w" in name and name.endswith(PACKED)


def packed_gathered_bytes(name: str) -> float | None:
    """FSDP gathers the packed codes and scales as they are stored: one byte an element."""
    return 1.0 if is_packed(name) else None


def expert_weight_count(args: LlamaArgs) -> int:
    """The experts' weights (w1, w2, w3 of every expert of every MoE layer)."""
    return len(args.moe_layers) * args.n_experts * 3 * args.dim * args.moe_ffn_dim


def dequantize_memory(ctx: PlanContext) -> list[PlanItem]:
    """One expert's weight dequantized for its matmul: its int32 code indices (4 bytes a byte, 2 a weight) and the
    values in the compute dtype."""
    if not ctx.model_args.moe_layers:
        return []
    numel = ctx.model_args.dim * ctx.model_args.moe_ffn_dim
    nbytes = int(numel * (2 + ctx.compute_bytes))
    return [PlanItem("buffers", nbytes, f"MXFP4 dequantization of one expert's weight ({numel:,} elements)")]


def plan_line(args: LlamaArgs) -> str:
    """DRY_RUN's summary line of the MXFP4 base."""
    numel = expert_weight_count(args)
    return (f"lora: MXFP4 base: the experts of {len(args.moe_layers)} MoE layers, {numel:,} weights in "
            f"{numel * BYTES_PER_WEIGHT / GIB:.2f} GiB ({BYTES_PER_WEIGHT} bytes each: 4-bit e2m1 codes + an E8M0 "
            f"scale per {BLOCK}) instead of {numel * 2 / GIB:.2f} GiB in bfloat16; kept as the folder's *_blocks / "
            "*_scales (or quantized from its unquantized experts), dequantized one expert at a time in the matmul")

