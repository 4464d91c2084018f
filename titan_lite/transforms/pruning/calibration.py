"""Sequential, block-by-block one-shot pruning on any FSDP/TP layout.

The calibration sequences (this data-parallel rank's share) are embedded once; then, block after block: forward
hooks on the block's linears accumulate their input statistics (one accumulator per input shared by several
linears), the statistics are all-reduced over the data-parallel ranks, every linear of the block is pruned, and the
cached hidden states go through the pruned block to become the next block's inputs. Blocks are called directly, so
FSDP gathers one block at a time; hooks see each linear's whole input (a tensor-parallel rowwise input is gathered).
Masks are chosen on the full weight matrix, identically on every rank, and each rank keeps its shard. With OWL's
layer ratios (pruning.layer_ratios = "owl") a first pass through the dense blocks scores every layer's outliers
(owl.py) and sets each layer's sparsity before the pruning pass.
"""

import contextlib
import fnmatch
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from titan_lite.config.schema import Pruning
from titan_lite.dtensor import copy_into_shard, full_tensor, local_tensor
from titan_lite.errors import ConfigError
from titan_lite.models.parameters import canonical_name
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms.pruning.masks import attach_mask, shard_like
from titan_lite.transforms.pruning.methods import InputSquares, Method, build_method
from titan_lite.transforms.pruning.owl import OutlierCount, owl_sparsities

logger = logging.getLogger("titan_lite")

# The linears of a block, and the input each reads: linears reading the same input share one accumulator.
INPUT_GROUPS = {
    "attention.wq": "attention", "attention.wk": "attention", "attention.wv": "attention",
    "attention.wo": "attention.wo",
    "feed_forward.w1": "feed_forward", "feed_forward.w3": "feed_forward",
    "feed_forward.w2": "feed_forward.w2",
    # Qwen3.5's Gated DeltaNet: four projections of the block's normed input, out_proj of the gated norm's output
    "attention.in_proj_qkv": "attention", "attention.in_proj_z": "attention", "attention.in_proj_b": "attention",
    "attention.in_proj_a": "attention", "attention.out_proj": "attention.out_proj",
    # Qwen3.5-MoE's gated shared expert, a SwiGLU of the MoE layer's input; its 1-wide gate (shared_expert_gate)
    # stays dense as the router does: it scales the whole expert's output, it is no projection to thin out
    "moe.shared_expert.w1": "moe", "moe.shared_expert.w3": "moe", "moe.shared_expert.w2": "moe.shared_expert.w2",
    # DeepSeek-V3's latent attention (its one-matrix query is wq): the down-projections read the block's normed input,
    # each up-projection its latent's norm output; a routed layer's shared experts read its feed-forward's input
    "attention.q_a_proj": "attention", "attention.kv_a_proj_with_mqa": "attention",
    "attention.q_b_proj": "attention.q_b_proj", "attention.kv_b_proj": "attention.kv_b_proj",
    "moe.shared_experts.w1": "moe.shared_experts", "moe.shared_experts.w3": "moe.shared_experts",
    "moe.shared_experts.w2": "moe.shared_experts.w2",
}
_BLOCK_LINEAR = re.compile(r"layers\.(\d+)\.(.+)")


@dataclass
class Target:
    """One linear to prune."""

    name: str  # canonical, e.g. layers.3.attention.wq
    module: nn.Module

    @property
    def layer(self) -> str:
        return _BLOCK_LINEAR.fullmatch(self.name).group(1)

    @property
    def group(self) -> str:
        return INPUT_GROUPS[_BLOCK_LINEAR.fullmatch(self.name).group(2)]

    @property
    def in_features(self) -> int:
        return self.module.weight.shape[1]


@dataclass
class LayerResult:
    name: str
    shape: list[int]
    pruned: int
    target_sparsity: float  # the layer's ratio: pruning.sparsity, or OWL's for its layer

    @property
    def sparsity(self) -> float:
        return self.pruned / (self.shape[0] * self.shape[1])


@dataclass
class PruneResult:
    """What the one-shot pass did: per pruned linear, and the linears left dense by `pruning.skip`."""

    layers: list[LayerResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    windows: int = 0
    seconds: float = 0.0
    outlier_ratios: dict[str, float] = field(default_factory=dict)  # OWL's D_l (percent) by layer id


def block_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(canonical name, module) of every linear of every transformer block (embeddings, norms, head excluded)."""
    for name, module in model.named_modules():
        name = canonical_name(name)
        match = _BLOCK_LINEAR.fullmatch(name)
        if match and match.group(2) in INPUT_GROUPS:
            yield name, module


def find_targets(model: nn.Module, skip: list[str]) -> tuple[dict[str, list[Target]], list[str]]:
    """(layer id -> its linears to prune, names left dense by the skip patterns)."""
    targets: dict[str, list[Target]] = {}
    skipped = []
    for name, module in block_linears(model):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in skip):
            skipped.append(name)
            continue
        target = Target(name, module)
        targets.setdefault(target.layer, []).append(target)
    return targets, skipped


def warn_unmatched(skip: list[str], skipped: list[str]) -> None:
    for pattern in skip:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in skipped):
            logger.warning(f"'pruning.skip' pattern '{pattern}' matches no linear layer")


# ------------------------------------------------------------------------------------------ the pass


class OneShotPruner:
    """Prunes one model part in place (no pipeline parallelism: the part is the whole model)."""

    def __init__(self, cfg: Pruning, parallel_dims: ParallelDims, device: torch.device,
                 forward_context: Callable[[], contextlib.AbstractContextManager]):
        self.cfg = cfg
        self.method: Method = build_method(cfg)
        self.dims = parallel_dims
        self.device = device
        self.forward_context = forward_context
        self.owl = cfg.layer_ratios == "owl"
        self.layer_sparsity: dict[str, float] = {}  # by layer id; pruning.sparsity where absent

    @torch.no_grad()
    def run(self, model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> PruneResult:
        begin = time.monotonic()
        targets, skipped = find_targets(model, self.cfg.skip)
        warn_unmatched(self.cfg.skip, skipped)
        result = PruneResult(skipped=skipped)
        # Compiled blocks run eagerly: the statistics hooks are Python side effects.
        with torch.compiler.set_stance("force_eager"):
            hidden: list[torch.Tensor] = []
            if self.method.needs_calibration or self.owl:
                tokens = self.local_windows(batches)
                result.windows = sum(t.shape[0] for t in tokens) * self.dims.dp_degree
                hidden = self.embed(model, tokens)
            if self.owl:
                result.outlier_ratios = self.owl_pass(model, targets, hidden)
                hidden.clear()  # the dense pass's last activations go before the pruning pass embeds again
                hidden = self.embed(model, tokens) if self.method.needs_calibration else []
            layer_ids = list(model.layers.keys())
            for position, layer_id in enumerate(layer_ids):
                block_begin = time.monotonic()
                block = model.layers[layer_id]
                block_targets = targets.get(layer_id, [])
                result.layers += self.prune_block(block, block_targets, hidden, model.rope_cache)
                if hidden and position < len(layer_ids) - 1:
                    self.propagate(block, hidden, model.rope_cache)
                if isinstance(block, FSDPModule):
                    block.reshard()
                at = f" at sparsity {self.sparsity_of(layer_id):.4f}" if self.owl else ""
                logger.info(f"prune: block {position + 1}/{len(layer_ids)}: {len(block_targets)} linears "
                            f"({self.cfg.method}, {self.cfg.pattern}){at} in {time.monotonic() - block_begin:.1f}s")
        result.seconds = time.monotonic() - begin
        return result

    def sparsity_of(self, layer_id: str) -> float:
        return self.layer_sparsity.get(layer_id, self.cfg.sparsity)

    # ---------------------------------------------------------------------------------- OWL's layer ratios

    def owl_pass(self, model: nn.Module, targets: dict[str, list[Target]],
                 hidden: list[torch.Tensor]) -> dict[str, float]:
        """Every layer's outlier ratio on the dense model (block by block, Wanda's statistics), then each layer's
        sparsity (self.layer_sparsity); returns the ratios. `hidden` ends as the last block's inputs."""
        counts: dict[str, OutlierCount] = {}
        layer_ids = list(model.layers.keys())
        for position, layer_id in enumerate(layer_ids):
            block, block_targets = model.layers[layer_id], targets.get(layer_id, [])
            if block_targets:
                stats = self.collect_statistics(block, block_targets, hidden, model.rope_cache, InputSquares)
                counts[layer_id] = self.count_outliers(block_targets, stats)
            if position < len(layer_ids) - 1:
                self.propagate(block, hidden, model.rope_cache)
            if isinstance(block, FSDPModule):
                block.reshard()
        sparsities = owl_sparsities([c.ratio for c in counts.values()], self.cfg.sparsity, self.cfg.owl_lambda)
        self.layer_sparsity = dict(zip(counts, sparsities, strict=True))
        logger.info("prune: OWL layer sparsities (outlier ratio %): " + ", ".join(
            f"{layer} {self.layer_sparsity[layer]:.4f} ({c.ratio:.3f})" for layer, c in counts.items()))
        return {layer: c.ratio for layer, c in counts.items()}

    def count_outliers(self, targets: list[Target], stats: dict) -> OutlierCount:
        """D_l of one layer: its linears' Wanda scores (full weights, the same on every rank) against M x their
        mean, scored twice (sum, then count) so that one linear's scores are alive at a time."""
        norms = {group: accumulator.sum.sqrt().float() for group, accumulator in stats.items()}
        count = OutlierCount(self.cfg.owl_m)
        for add in (count.add, count.count):
            for target in targets:
                weight = full_tensor(target.module.weight.detach()).to(torch.float32, copy=True)
                add(weight.abs_().mul_(norms[target.group][None, :]))
        return count

    # ---------------------------------------------------------------------------------- calibration data

    def local_windows(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """This rank's calibration token batches; every data-parallel rank must hold its full share, or the
        collectives inside the block forwards would not line up."""
        tokens = [inputs for inputs, _ in batches]
        local = sum(t.shape[0] for t in tokens)
        wanted = self.cfg.nsamples // self.dims.dp_degree
        short = torch.tensor([int(local < wanted)], device=self.device)
        if self.dims.dp_degree > 1:
            dist.all_reduce(short, group=self.dims.submesh("batch").get_group())
        if int(short):
            where = self.cfg.dataset_path or self.cfg.dataset
            raise ConfigError(f"calibration data '{where}' holds fewer than 'pruning.nsamples' = {self.cfg.nsamples} "
                              f"windows of 'pruning.seq_len' = {self.cfg.seq_len} tokens; lower either, or add data")
        return tokens

    def embed(self, model: nn.Module, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """The first block's inputs (this rank's sequence shard under TP) for each token batch."""
        if isinstance(model, FSDPModule):
            self.initialise_fsdp(model)
        with self.forward_context(), unsharded(model):
            return [model.tok_embeddings(t) for t in tokens]

    def initialise_fsdp(self, model: FSDPModule) -> None:
        """FSDP2 designates its root on the first forward through the root: run one of a few tokens, then free
        every gathered group (blocks are then called one by one)."""
        with self.forward_context():
            model(torch.zeros(1, self.dims.tp, dtype=torch.long, device=self.device))
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # ---------------------------------------------------------------------------------- one block

    def prune_block(self, block: nn.Module, targets: list[Target], hidden: list[torch.Tensor],
                    rope: torch.Tensor) -> list[LayerResult]:
        calibrate = self.method.needs_calibration and targets
        stats = self.collect_statistics(block, targets, hidden, rope) if calibrate else {}
        results = []
        for group in dict.fromkeys(t.group for t in targets):  # in block order
            prepared = self.method.prepare(stats.pop(group)) if group in stats else None
            results += [self.prune_linear(t, prepared) for t in targets if t.group == group]
            del prepared
        return results

    def collect_statistics(self, block: nn.Module, targets: list[Target], hidden: list[torch.Tensor],
                           rope: torch.Tensor, make_statistics: Callable | None = None) -> dict:
        """One accumulator per input group (the method's, or make_statistics'), filled by a hook on the group's
        first linear over this rank's calibration batches, then summed over the data-parallel ranks."""
        make_statistics = make_statistics or self.method.statistics
        stats, handles = {}, []
        for target in targets:
            if target.group not in stats:
                stats[target.group] = make_statistics(target.in_features, self.device)
                handles.append(target.module.register_forward_hook(partial(accumulate, stats[target.group])))
        try:
            with self.forward_context():
                for h in hidden:
                    block(h, rope)
        finally:
            for handle in handles:
                handle.remove()
        if self.dims.dp_degree > 1:
            group = self.dims.submesh("batch").get_group()
            for accumulator in stats.values():
                accumulator.all_reduce(group)
        return stats

    def prune_linear(self, target: Target, prepared) -> LayerResult:
        """Choose the mask on the full weight (the same on every rank), keep this rank's shard of the mask and,
        for SparseGPT, of the updated weight."""
        weight = target.module.weight
        full = full_tensor(weight.detach())
        full = full.to(torch.float32, copy=self.method.updates_weights)
        sparsity = self.sparsity_of(target.layer)
        pruned = self.method.prune(full, prepared, sparsity)
        if self.method.updates_weights:
            copy_into_shard(weight, full.to(weight.dtype))
        keep = shard_like(weight, ~pruned)
        local_tensor(weight).mul_(local_tensor(keep))
        if self.cfg.hold_masks:
            attach_mask(target.module, keep)
        return LayerResult(target.name, list(weight.shape), int(pruned.sum()), sparsity)

    def propagate(self, block: nn.Module, hidden: list[torch.Tensor], rope: torch.Tensor) -> None:
        """The pruned block's outputs replace its inputs, batch by batch (no second copy of the cache)."""
        with self.forward_context():
            for i, h in enumerate(hidden):
                hidden[i] = block(h, rope)


def accumulate(stats, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    """Forward hook: add the linear's whole input (gathered over TP for a rowwise layer) to its accumulator."""
    x = full_tensor(args[0])
    stats.add(x.reshape(-1, x.shape[-1]))


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """The root FSDP group gathered (a tied embedding lives there) while its modules are called directly."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
