"""LoRA as a model transform: LoRA, rsLoRA, PiSSA and DoRA adapters, PEFT folders, merging (registers "lora")."""

from titan_lite.transforms.lora.module import LoRALinear
from titan_lite.transforms.lora.transform import LoraTransform

__all__ = ["LoRALinear", "LoraTransform"]
