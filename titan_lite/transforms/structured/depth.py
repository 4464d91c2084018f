"""Depth pruning (ShortGPT, arXiv 2403.03853): each block's influence on calibration data, the blocks removed, the
keep-set of the shallower dense Llama, and the memory of the scoring pass.

Block influence BI_i = 1 - mean over tokens of cos(x_i, y_i), with x_i and y_i block i's input and output hidden
states (the residual stream before the final norm): a block whose output is most like its input changes least and
goes first. The scores come from forward passes of the assembled (FSDP/TP/CP-sharded) dense model, hooks on every
block summing 1 - cos over the tokens each rank holds; the sums and token counts are all-reduced over every rank, so
a token held by several ranks (replicated activations) weighs the same as any other and every rank ranks the same
numbers (icip-cas/ShortGPT sums per-token 1 - cos the same way; its last block's output is taken after the final
norm, titan_lite's before it).
"""

import logging
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from titan_lite.dtensor import local_tensor
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner
from titan_lite.transforms.base import PassPlan
from titan_lite.transforms.pruning.memory_plan import Precision, block_forward_bytes, format_bytes, weight_bytes
from titan_lite.transforms.structured.materialize import StructureKeep, depth_keep_of

logger = logging.getLogger("titan_lite")


def check_depth_layout(dims: ParallelDims) -> None:
    if dims.pp_enabled:
        raise ConfigError(f"depth pruning does not run under pipeline parallelism (degree {dims.pp}): every block's "
                          "input and output are scored in one forward; use FSDP and/or tensor parallelism")


def _accumulate(sums: Tensor, index: int, module: nn.Module, args: tuple, output: Tensor) -> None:
    """Forward hook of block `index`: add sum(1 - cos(input, output)) over this rank's tokens and their count."""
    x = local_tensor(args[0]).flatten(0, -2).float()
    y = local_tensor(output).flatten(0, -2).float()
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1, eps=1e-12)
    sums[0, index] += (1 - cos).sum(dtype=torch.float64)
    sums[1, index] += cos.numel()


@torch.no_grad()
def calibration_forwards(runner: ModelRunner, batches: list[tuple[Tensor, Tensor]], method: str) -> None:
    """The model's forward over every calibration batch (its hooks observe), eager, with a progress line each."""
    model, begin = runner.model_parts[0], time.monotonic()
    with torch.compiler.set_stance("force_eager"):  # compiled blocks would recompile for calibration shapes
        for i, (inputs, labels) in enumerate(batches, start=1):
            inputs, _ = runner.shard(inputs, labels)
            with runner.context():
                runner.logits(model, inputs, {})
            logger.info(f"{method}: calibration batch {i}/{len(batches)} ({time.monotonic() - begin:.1f}s)")


def block_influence(runner: ModelRunner, batches: list[tuple[Tensor, Tensor]], device: torch.device) -> list[float]:
    """BI of every block (in the model's layer order) over every rank's calibration batches (a collective)."""
    model = runner.model_parts[0]
    blocks = list(model.layers.values())
    sums = torch.zeros(2, len(blocks), dtype=torch.float64, device=device)
    handles = [block.register_forward_hook(partial(_accumulate, sums, i)) for i, block in enumerate(blocks)]
    try:
        calibration_forwards(runner, batches, "depth")
    finally:
        for handle in handles:
            handle.remove()
    if isinstance(model, FSDPModule):
        model.reshard()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).tolist()


def blocks_to_remove(scores: list[float], count: int) -> list[int]:
    """The `count` blocks of lowest influence (ties: the earlier block), ascending."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    return sorted(order[:count])


def check_removal(removed: list[int], n_layers: int, flag: str) -> None:
    """One line for a removal that leaves no valid model."""
    if len(set(removed)) != len(removed):
        raise ConfigError(f"{flag} names a block twice: {removed}")
    outside = [i for i in removed if not 0 <= i < n_layers]
    if outside:
        raise ConfigError(f"{flag}: the model has blocks 0 to {n_layers - 1}; {outside} are not among them")
    if len(removed) >= n_layers:
        raise ConfigError(f"{flag} would remove all {n_layers} blocks; keep at least one")
    if not removed:
        raise ConfigError(f"{flag} removes no block: name at least one (it would write an unpruned copy)")


def depth_keep(args: LlamaArgs, removed: list[int]) -> StructureKeep:
    """Every block but the removed ones, each whole (all heads, channels and hidden dims)."""
    return depth_keep_of(args, [i for i in range(args.n_layers) if i not in set(removed)])


def depth_pass_plan(args: LlamaArgs, dims: ParallelDims, parts: list[nn.Module], nsamples: int, batch_size: int,
                    seq_len: int, p: Precision) -> PassPlan:
    """One rank's peak while scoring: its weights, a forward of batch_size x seq_len tokens (a block's working set
    and its FSDP all-gather, or the output head's logits), the hooks' float32 copies of a block's input and
    output, and the scores."""
    weights, local = weight_bytes(parts)
    tokens = batch_size * seq_len // dims.cp
    gather = two_groups_gathered(parts, dims, p) if dims.fsdp_enabled or dims.dp_replicate_enabled else 0
    block = max(block_forward_bytes(args, i, tokens, dims.tp, p, {}) for i in range(args.n_layers))
    hooks = 3 * (tokens // dims.tp) * args.dim * 4 + tokens * 4
    vocab = args.vocab_size // dims.tp if dims.tp > 1 else args.vocab_size
    logits = tokens * vocab * p.matmul + tokens * args.dim * p.hidden
    working = gather + max(block + hooks, logits)
    rows = [f"  {'weights':<18}{format_bytes(weights):>12}  {local:,} local parameters x {p.name} (+ buffers)",
            f"  {'working':<18}{format_bytes(working):>12}  a forward of {batch_size} x {seq_len} tokens: "
            f"{'a block with its hooks' if block + hooks >= logits else 'the logits'}"
            + (" (+ the 2 largest FSDP groups all-gathered)" if gather else ""),
            f"  {'peak':<18}{format_bytes(weights + working):>12}"]
    return PassPlan("depth pruning", f"depth pruning: block influence on {nsamples} x {seq_len} calibration tokens, "
                    "per device:", rows, weights + working,
                    "lower --batch_size or --seq_len, or shard over more devices (torchrun)")


def two_groups_gathered(parts: list[nn.Module], dims: ParallelDims, p: Precision) -> int:
    """The gathered parameters of the two largest FSDP groups (one computing, the next prefetched): two blocks, or
    the head and a block."""
    shard = dims.dp_shard * dims.cp
    groups = [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]
    sizes = []
    for group in groups:
        nested = {id(w) for child in group.modules() if child is not group and isinstance(child, FSDPModule)
                  for w in child.parameters()}
        sizes.append(sum(local_tensor(w).numel() for w in group.parameters() if id(w) not in nested) * shard)
    return sum(sorted(sizes)[-2:]) * p.matmul
