"""Adapters folded for decoding: each LoRALinear's weight becomes W + s B A (DoRA's rescaled rows; keep_sparsity's
masked update) for a rollout, so every decode step runs the base's matmuls only, and the saved base is copied back
bit for bit after it. Folded where the product stays exact to float32 rounding; why not, said once."""

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from titan_lite.dtensor import local_tensor
from titan_lite.transforms.lora.module import LoRALinear, merged_weight
from titan_lite.transforms.nf4 import is_nf4

logger = logging.getLogger("titan_lite")


def fold_blocker(module: LoRALinear, compute: torch.dtype) -> str | None:
    """Why folding this module's adapter would change what decoding computes, or None when it may be folded."""
    if is_nf4(module.weight):
        return ("QLoRA's NF4 base stays quantized (a folded weight would be a dense copy of every adapted weight; "
                "see docs/rl.md for the measured speed)")
    if compute != torch.float32:
        return (f"the compute dtype is {str(compute).removeprefix('torch.')}: the folded weight would round the "
                "update into it (exact only in float32)")
    if module.weight.dtype != torch.float32:
        return (f"the base is stored in {str(module.weight.dtype).removeprefix('torch.')}: the folded weight would "
                "round the update into it")
    if module.base_linear is not None:
        return "another transform computes the base product (float8)"
    return None


@contextlib.contextmanager
def folded(modules: list[LoRALinear]) -> Iterator[None]:
    """Within it each module's weight (its local shard under FSDP or TP) holds its adapted weight and the module
    multiplies it alone; on exit the saved base is copied back and the adapter applies again. Collective when the
    weights are sharded (the factors' shards are redistributed to the weight's), so every rank folds the same list."""
    saved: list[tuple[LoRALinear, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for module in modules:
                adapted = adapted_shard(module)
                target = local_tensor(module.weight)
                saved.append((module, target.clone()))
                target.copy_(adapted)
                module.folded = True
        yield
    finally:
        with torch.no_grad():
            for module, base in reversed(saved):
                local_tensor(module.weight).copy_(base)
                module.folded = False


def adapted_shard(module: LoRALinear) -> torch.Tensor:
    """This rank's piece of W + s B A (rescaled by DoRA), laid out as its piece of W."""
    weight = module.weight
    adapted = merged_weight(weight, module.lora_a, module.lora_b, module.scale, module.magnitude,
                            keep_sparsity=module.keep_sparsity)
    if isinstance(adapted, DTensor):
        adapted = adapted.redistribute(weight.device_mesh, weight.placements).to_local()
    return adapted


def fold_report(modules: list[LoRALinear], blockers: dict[str, list[str]], experts: int) -> str:
    """The one line a run logs at its first rollout."""
    line = f"lora: the rollout decodes with {len(modules)} adapters folded into their base weights"
    if len(modules):
        line += " (restored bit for bit after it)"
    for reason, names in blockers.items():
        line += f"; {len(names)} kept apart: {reason}"
    if experts:
        line += f"; {experts} experts' adapters applied apart (grouped experts are not folded)"
    return line
