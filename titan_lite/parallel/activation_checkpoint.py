"""Activation checkpointing of transformer blocks: full, every N-th block, or per-op selective (op SAC)."""

from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_lite.config.schema import ActivationCheckpoint

aten = torch.ops.aten

# Attention kernels are costly to recompute and their outputs are small relative to their cost: always saved.
_SDPA_OPS = [
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
]
SAVED_OPS = {getattr(aten, name).default for name in _SDPA_OPS if hasattr(aten, name)}
# Recomputing a tensor-parallel reduce-scatter would repeat the communication.
SAVED_OPS.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
MM_OPS = {aten.mm.default}


def apply_ac(model: nn.Module, ac: ActivationCheckpoint) -> None:
    """Replace blocks in model.layers by checkpointed wrappers according to [activation_checkpoint]."""
    if ac.mode == "none":
        return
    every = 1
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        every = int(ac.selective_ac_option)
    per_op = ac.mode == "selective" and ac.selective_ac_option == "op"
    for position, (name, block) in enumerate(list(model.layers.named_children()), start=1):
        if position % every == 0:
            model.layers.register_module(name, wrap_block(block, ac, per_op))


def wrap_block(block: nn.Module, ac: ActivationCheckpoint, per_op: bool) -> nn.Module:
    """A non-reentrant checkpoint wrapper; per_op adds the selective save/recompute policy."""
    kwargs = dict(preserve_rng_state=ac.preserve_rng_state, determinism_check=ac.determinism_check,
                  debug=ac.debug, early_stop=ac.early_stop)
    if per_op:
        forced = forced_mm_shapes(block, ac.per_op_sac_force_recompute_mm_shapes_by_fqns)
        kwargs["context_fn"] = partial(selective_context_fn, forced)
    return checkpoint_wrapper(block, **kwargs)


def forced_mm_shapes(block: nn.Module, fqns: list[str]) -> frozenset[tuple[int, int]]:
    """The shapes aten.mm sees as its second argument (the transposed weight) for the block's Linear layers whose
    name ends with one of fqns. Matching is by shape: another mm with the same weight shape is recomputed too."""
    return frozenset((m.weight.shape[1], m.weight.shape[0]) for name, m in block.named_modules()
                     if isinstance(m, nn.Linear) and _ends_with_any(name, fqns))


def _ends_with_any(name: str, fqns: list[str]) -> bool:
    return any(name == fqn or name.endswith("." + fqn) for fqn in fqns)


def selective_context_fn(forced: frozenset[tuple[int, int]] = frozenset()):
    """Fresh contexts per checkpointed call: the mm counter restarts for forward and for its recompute."""
    counts: dict[bool, int] = defaultdict(int)
    return create_selective_checkpoint_contexts(partial(save_policy, counts, forced))


def save_policy(counts: dict[bool, int], forced: frozenset[tuple[int, int]], ctx, op, *args,
                **kwargs) -> CheckpointPolicy:
    """Save SDPA outputs and every other mm output; recompute the rest, and always the mm with a forced weight shape.

    Forward and recompute each count mm calls separately (keyed by ctx.is_recompute) so both make the same choice;
    forced mm are not counted.
    """
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    if op in MM_OPS:
        if tuple(args[1].shape) in forced:
            return CheckpointPolicy.PREFER_RECOMPUTE
        counts[ctx.is_recompute] += 1
        recompute = counts[ctx.is_recompute] % 2 == 0
        return CheckpointPolicy.PREFER_RECOMPUTE if recompute else CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
