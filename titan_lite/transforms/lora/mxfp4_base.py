"""LoRA on an MXFP4 base (lora.base_dtype = "mxfp4"): gpt-oss's experts kept in the release's 4-bit form under their
adapters (or none), filled from the base's folder after load, never saved, and the refusals, each one line."""

from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.mxfp4 import BLOCK
from titan_lite.models.parts.experts import GroupedExperts
from titan_lite.transforms.lora.experts import LoRAGroupedExperts, adapted_experts
from titan_lite.transforms.mxfp4 import MXFP4Projections, pack_experts

MXFP4 = "mxfp4"
RELEASED_IN_MXFP4 = ("gpt_oss",)  # the families whose experts are released as MXFP4 blocks and scales


class MXFP4LoRAGroupedExperts(MXFP4Projections, LoRAGroupedExperts):
    """Adapted grouped experts (any subset of gate_up / down, possibly none) over an MXFP4 frozen base."""


def mxfp4_experts(experts: GroupedExperts, adapters: dict[str, tuple[int, float]]) -> MXFP4LoRAGroupedExperts:
    """The experts with their weights packed (on the meta device: nothing is allocated) and `adapters` on top."""
    module = adapted_experts(experts, adapters, MXFP4LoRAGroupedExperts)
    pack_experts(module)
    return module


def base_folder(cfg: JobConfig) -> str | None:
    """The Hugging Face folder the run's initial weights come from (None: not an HF folder)."""
    c = cfg.checkpoint
    return (c.initial_load_path or cfg.model.hf_assets_path) if c.initial_load_in_hf else None


def check_mxfp4(cfg: JobConfig, args: LlamaArgs) -> None:
    """Refusals of an MXFP4 base before launch, each one line."""
    if args.family not in RELEASED_IN_MXFP4 or not args.moe_layers:
        raise ConfigError(f"lora.base_dtype='mxfp4' needs a model whose experts are released in MXFP4 (gpt-oss: "
                          f"model_type {', '.join(RELEASED_IN_MXFP4)}); this model is '{args.family}'"
                          f"{'' if args.moe_layers else ' without MoE layers'}: use base_dtype 'nf4' (QLoRA) or "
                          "'bfloat16'")
    others = [name for name in cfg.model.converters if name != "lora"]
    if others:
        raise ConfigError(f"lora.base_dtype='mxfp4' cannot be combined with converter '{others[0]}' in "
                          "'model.converters': it would read or rewrite the experts' weights, which stay packed in "
                          "4 bits; use base_dtype 'bfloat16' with it, or drop it")
    for what, width in (("dim (hidden_size)", args.dim), ("moe_ffn_dim (intermediate_size)", args.moe_ffn_dim)):
        if width % BLOCK:
            raise ConfigError(f"lora.base_dtype='mxfp4' needs the experts' input widths in whole {BLOCK}-value "
                              f"blocks; the model's {what} is {width}")
    if base_folder(cfg) is None:
        raise ConfigError("lora.base_dtype='mxfp4' keeps the experts of the base's Hugging Face folder: set "
                          "'checkpoint.initial_load_in_hf' = true (the folder: 'checkpoint.initial_load_path' or "
                          "'model.hf_assets_path')")


def packed_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, MXFP4Projections)]
