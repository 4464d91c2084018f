"""Expert pruning of mixture-of-experts layers (REAP, Cerebras, arXiv 2510.13999): each expert's score on
calibration data, the lowest-scoring experts of every MoE layer removed with their router rows, the smaller model's
state dict and args, and the memory of the scoring pass.

REAP's score of expert j in a layer is the mean, over the calibration tokens routed to j, of g_j(x) ||f_j(x)||_2:
the router weight the layer multiplies j's output by (after Qwen3's top-k renormalisation) times the L2 norm of
that output. `frequency` scores an expert by the share of the layer's routed (token, expert) pairs it received
instead. Forward hooks on every MoE layer's router and experts sum g ||f|| and the routed count per expert over the
tokens each rank holds; the sums are all-reduced over every rank (tokens held by several ranks, as under TP, weigh
the same as others), so every rank ranks the same numbers.
"""

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from titan_lite.dtensor import local_tensor
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.parameters import canonical_name
from titan_lite.models.parts.group_router import check_groups
from titan_lite.models.parts.moe import MoE
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner
from titan_lite.transforms.base import PassPlan
from titan_lite.transforms.pruning.memory_plan import Precision, block_forward_bytes, format_bytes, weight_bytes
from titan_lite.transforms.structured.depth import calibration_forwards, two_groups_gathered

logger = logging.getLogger("titan_lite")
EXPERT_SCORES = ("reap", "frequency")
# An MoE layer's tensors with a row per expert (the biases where the family has them: gpt-oss)
_PER_EXPERT = ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3", "moe.experts.b1", "moe.experts.b2",
               "moe.experts.b3", "moe.router.gate.weight", "moe.router.gate.bias",
               "moe.router.e_score_correction_bias")  # DeepSeek-V3's: removed with its expert


def check_reap_model(args: LlamaArgs, ratio: float, source: str) -> int:
    """Experts kept per MoE layer, or one ConfigError line: a dense model, a ratio outside (0, 1), or one that leaves
    fewer experts than each token is routed to."""
    if not args.n_experts:
        raise ConfigError(f"--method reap removes experts, but {source} is a dense {args.family} model with none; "
                          "use wanda, sparsegpt, taylor_structured or depth")
    if not 0.0 < ratio < 1.0:
        raise ConfigError(f"--expert_ratio {ratio} must be a fraction in (0, 1) of each MoE layer's experts")
    kept = args.n_experts - round(args.n_experts * ratio)
    if kept < args.moe_top_k:
        raise ConfigError(f"--expert_ratio {ratio} leaves {kept} of the {args.n_experts} experts of each MoE layer, "
                          f"fewer than num_experts_per_tok = {args.moe_top_k} (each token needs that many distinct "
                          "experts)")
    if kept == args.n_experts:
        raise ConfigError(f"--expert_ratio {ratio} removes no expert of {args.n_experts}; raise it")
    if args.moe_router == "sigmoid_group":  # the kept experts, renumbered in order, fill n_group equal groups
        try:
            check_groups(kept, args.moe_top_k, args.moe_n_group, args.moe_topk_group, "")
        except ConfigError as exc:
            reason = str(exc).removeprefix(": ")
            raise ConfigError(f"--expert_ratio {ratio} leaves {kept} of the {args.n_experts} experts of each MoE "
                              f"layer, which n_group = {args.moe_n_group} groups cannot hold ({reason})") from None
    return kept


def check_reap_layout(dims: ParallelDims) -> None:
    if dims.pp_enabled:
        raise ConfigError(f"REAP does not run under pipeline parallelism (degree {dims.pp}): every MoE layer is "
                          "scored in one forward; use FSDP and/or tensor parallelism")


# ------------------------------------------------------------------------------------------ scores


@dataclass
class ExpertSums:
    """Per MoE layer (global layer id): sum of g ||f|| and routed count per expert, float64."""

    weighted_norms: dict[int, Tensor] = field(default_factory=dict)
    counts: dict[int, Tensor] = field(default_factory=dict)


class ExpertObserver:
    """Forward hooks on the MoE layers of model parts that add each expert's g ||f|| and routed count: the router's
    hook keeps the layer's routing, the experts' hook (rows grouped by expert) pairs each row's output norm with its
    gate weight."""

    def __init__(self, model_parts: list[nn.Module], device: torch.device):
        self.sums = ExpertSums()
        self.handles = []
        for part in model_parts:
            for name, module in part.named_modules():
                if isinstance(module, MoE):
                    self.watch(int(canonical_name(name).split(".")[1]), module, device)

    def watch(self, layer: int, moe: MoE, device: torch.device) -> None:
        n_experts = moe.router.gate.out_features
        self.sums.weighted_norms[layer] = torch.zeros(n_experts, dtype=torch.float64, device=device)
        self.sums.counts[layer] = torch.zeros(n_experts, dtype=torch.float64, device=device)
        routing: dict[str, Tensor] = {}

        def on_router(module, args, output) -> None:
            _, weights, experts = output
            flat = experts.flatten()
            order = torch.argsort(flat, stable=True)  # the rows' order in the experts' call (Routing.of)
            routing["weights"], routing["experts"] = weights.flatten()[order], flat[order]

        def on_experts(module, args, output) -> None:
            norms = local_tensor(output).float().norm(dim=-1).double()
            weighted = routing["weights"].double() * norms
            self.sums.weighted_norms[layer].index_add_(0, routing["experts"], weighted)
            self.sums.counts[layer].index_add_(0, routing["experts"], torch.ones_like(weighted))

        self.handles += [moe.router.register_forward_hook(on_router), moe.experts.register_forward_hook(on_experts)]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def scores_of(sums: ExpertSums, kind: str) -> dict[int, list[float]]:
    """Each MoE layer's expert scores: REAP's mean g ||f|| over the tokens routed to the expert (0 for an expert no
    token reached), or the expert's share of the layer's routed pairs."""
    out = {}
    for layer, counts in sorted(sums.counts.items()):
        if kind == "reap":
            out[layer] = (sums.weighted_norms[layer] / counts.clamp(min=1)).tolist()
        else:
            out[layer] = (counts / counts.sum().clamp(min=1)).tolist()
    return out


@torch.no_grad()
def expert_sums(runner: ModelRunner, batches: list[tuple[Tensor, Tensor]], device: torch.device) -> ExpertSums:
    """The sums over every rank's calibration batches (a collective)."""
    model = runner.model_parts[0]
    observer = ExpertObserver(runner.model_parts, device)
    try:
        calibration_forwards(runner, batches, "reap")
    finally:
        observer.close()
    if isinstance(model, FSDPModule):
        model.reshard()
    if dist.is_initialized() and dist.get_world_size() > 1:
        for tensor in [*observer.sums.weighted_norms.values(), *observer.sums.counts.values()]:
            dist.all_reduce(tensor)
    return observer.sums


def experts_to_keep(scores: dict[int, list[float]], kept: int) -> dict[int, list[int]]:
    """Per MoE layer, the `kept` highest-scoring experts (ties: the earlier expert stays), ascending."""
    out = {}
    for layer, values in scores.items():
        order = sorted(range(len(values)), key=lambda j: (-values[j], j))
        out[layer] = sorted(order[:kept])
    return out


# ------------------------------------------------------------------------------------------ the smaller model


def without_experts(state: dict[str, Tensor], args: LlamaArgs,
                    keep: dict[int, list[int]]) -> tuple[dict[str, Tensor], LlamaArgs]:
    """The state dict and args of the model that keeps only `keep`'s experts in every MoE layer: their grouped
    weights and their router rows (gpt-oss: with their biases and the router's), renumbered in ascending original
    order."""
    counts = {len(k) for k in keep.values()}
    if len(counts) != 1:
        raise ValueError(f"every MoE layer must keep the same number of experts, got {sorted(counts)}")
    out = dict(state)
    for layer, kept in keep.items():
        index = torch.tensor(kept)
        for name in _PER_EXPERT:
            key = f"layers.{layer}.{name}"
            if key in state:
                out[key] = state[key].index_select(0, index.to(state[key].device)).clone()
    new_args = LlamaArgs(**{**vars(args), "n_experts": counts.pop()})
    return out, new_args


def model_param_count(args: LlamaArgs) -> int:
    """Parameters of a model with these args (counted on the meta device; a tied head once)."""
    with torch.device("meta"):
        return Llama(args).num_params()


# ------------------------------------------------------------------------------------------ the plan


def reap_pass_plan(args: LlamaArgs, dims: ParallelDims, parts: list[nn.Module], nsamples: int, batch_size: int,
                   seq_len: int, p: Precision) -> PassPlan:
    """One rank's peak while scoring: its weights, a forward of batch_size x seq_len tokens (a block's working set,
    with the routed rows of an MoE layer, and its FSDP all-gather, or the output head's logits), the hooks' float32
    norms of the routed rows and the sums."""
    weights, local = weight_bytes(parts)
    tokens = batch_size * seq_len // dims.cp
    gather = two_groups_gathered(parts, dims, p) if dims.fsdp_enabled or dims.dp_replicate_enabled else 0
    block = max(block_forward_bytes(args, i, tokens, dims.tp, p, {}) for i in range(args.n_layers))
    rows = tokens * args.moe_top_k
    hooks = rows * args.dim * 4 + 4 * rows * 8 + 2 * len(args.moe_layers) * args.n_experts * 8
    vocab = args.vocab_size // dims.tp if dims.tp > 1 else args.vocab_size
    logits = tokens * vocab * p.matmul + tokens * args.dim * p.hidden
    working = gather + max(block + hooks, logits)
    rows_text = [f"  {'weights':<18}{format_bytes(weights):>12}  {local:,} local parameters x {p.name} (+ buffers)",
                 f"  {'working':<18}{format_bytes(working):>12}  a forward of {batch_size} x {seq_len} tokens: "
                 f"{'a block with its routed rows and hooks' if block + hooks >= logits else 'the logits'}"
                 + (" (+ the 2 largest FSDP groups all-gathered)" if gather else ""),
                 f"  {'peak':<18}{format_bytes(weights + working):>12}"]
    return PassPlan("REAP", f"REAP: expert scores on {nsamples} x {seq_len} calibration tokens, per device:",
                    rows_text, weights + working, "lower --batch_size or --seq_len, or shard over more devices "
                    "(torchrun)")
