"""The peak memory of the one-shot pruning pass per device, estimated from the model shapes and the layout before
any weight is read: weights, masks, the calibration cache of one block's inputs, the statistics of one block, and
the largest working set (a calibration batch through a block with its hooks, or the pruning of one linear)."""

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from titan_lite.config.schema import JobConfig, Pruning
from titan_lite.distributed import compute_dtype
from titan_lite.dtensor import local_tensor
from titan_lite.models.args import LlamaArgs
from titan_lite.parallel.memory_estimate import GIB
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms.pruning.calibration import Target, find_targets
from titan_lite.transforms.pruning.masks import SORT_CHUNK_ELEMENTS
from titan_lite.transforms.pruning.methods import build_method, calibrates

FP32, FP64, INT64, BOOL = 4, 8, 8, 1
MIB = 1024**2


def format_bytes(nbytes: int) -> str:
    """GiB from one GiB up, else MiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


@dataclass(frozen=True)
class Precision:
    """Bytes per element: parameters as stored, the hidden states between blocks, matmul outputs inside a block."""

    param: int
    hidden: int
    matmul: int
    name: str


@dataclass
class PruningMemoryPlan:
    """Peak bytes on one device by category; the working set is the larger of its two phases (named in notes)."""

    weights: int
    masks: int
    cache: int
    statistics: int
    working: int
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return self.weights + self.masks + self.cache + self.statistics + self.working

    def lines(self, capacity_gib: float | None) -> list[str]:
        rows = [("weights", self.weights), ("masks", self.masks), ("calibration cache", self.cache),
                ("statistics", self.statistics), ("working", self.working)]
        scale, unit = (GIB, "GiB") if self.peak >= GIB else (MIB, "MiB")
        out = [f"  {name:<18}{b / scale:9.2f} {unit}  {self.notes.get(name, '')}".rstrip() for name, b in rows]
        out.append(f"  {'peak':<18}{self.peak / scale:9.2f} {unit}")
        if capacity_gib is not None:
            out.append(f"  verdict: {self.verdict(capacity_gib)}")
        return out

    def fits(self, capacity_gib: float) -> bool:
        return self.peak / GIB <= capacity_gib

    def verdict(self, capacity_gib: float) -> str:
        peak = self.peak / GIB
        if self.fits(capacity_gib):
            return f"fits: peak {peak:.2f} GiB of {capacity_gib:.2f} GiB, head-room {capacity_gib - peak:.2f} GiB"
        return f"does NOT fit: peak {peak:.2f} GiB exceeds {capacity_gib:.2f} GiB by {peak - capacity_gib:.2f} GiB"


# ------------------------------------------------------------------------------------------ pieces


def _local_numel(t: torch.Tensor) -> int:
    return local_tensor(t).numel()


def weight_bytes(parts: list[nn.Module]) -> tuple[int, int]:
    """(bytes of this rank's parameters and buffers, local parameter count)."""
    params = [p for part in parts for p in part.parameters()]
    buffers = [b for part in parts for b in part.buffers()]
    total = sum(_local_numel(t) * t.element_size() for t in [*params, *buffers])
    return total, sum(map(_local_numel, params))


def _per_rank(args: LlamaArgs, layer: int, tp: int) -> tuple[int, int, int, int]:
    """(dim, query width, kv width, ffn width) one TP rank computes in a block."""
    q_heads, kv_heads = args.heads_of(layer)
    return args.dim, q_heads * args.head_dim // tp, kv_heads * args.head_dim // tp, args.ffn_dim_of(layer) // tp


def _widen(nbytes: int) -> int:
    """Bytes of an fp32 copy a hook makes of a tensor of matmul-dtype elements (none when already fp32)."""
    return 0 if nbytes == FP32 else FP32


def hook_bytes(method: str, elements: int, p: Precision) -> int:
    """Temporaries of the statistics hook on one input of `elements` values: the fp32 view or copy, then Wanda's
    squares (SparseGPT multiplies straight into its Hessian)."""
    squares = elements * FP32 if method == "wanda" else 0
    return elements * _widen(p.matmul) + squares


def block_forward_bytes(args: LlamaArgs, layer: int, tokens: int, tp: int, p: Precision,
                        hooks: dict[str, int]) -> int:
    """Peak bytes alive inside one block call for `tokens` tokens, beyond its input: the attention at its output
    projection, or the feed-forward at the product of its two branches or at its output projection, whichever is
    larger. `hooks` maps 'attention', 'attention.wo', 'feed_forward', 'feed_forward.w2' to hook temporaries."""
    dim, q, kv, ffn = _per_rank(args, layer, tp)
    seq_shard = tokens // tp
    norm = seq_shard * dim * p.hidden + (tokens * dim * p.matmul if tp > 1 else 0)  # SP gathers the norm output
    # q, k, v (roped, in matmul dtype), the attention output and its [tokens, heads x head_dim] copy, the output.
    at_wo = norm + tokens * (3 * q + 2 * kv) * p.matmul + tokens * dim * p.matmul + hooks.get("attention.wo", 0)
    # Rotating q: its fp32 pairs, the two rotated halves and their stack.
    at_rope = norm + tokens * (q + 2 * kv) * p.matmul + tokens * q * (_widen(p.matmul) + 2 * FP32)
    at_qkv = norm + tokens * (q + 2 * kv) * p.matmul + hooks.get("attention", 0)
    if args.layer_type(layer) == "linear_attention":
        at_wo = at_rope = at_qkv = norm + deltanet_forward_bytes(args, tokens, p, hooks)
    residual = seq_shard * dim * p.hidden  # h = x + attention(...)
    if args.is_moe_layer(layer):
        return max(at_wo, at_rope, at_qkv, residual + norm + moe_forward_bytes(args, tokens, p))
    at_product = residual + norm + 3 * tokens * ffn * p.matmul
    at_w2 = residual + norm + tokens * ffn * p.matmul + tokens * dim * p.matmul + hooks.get("feed_forward.w2", 0)
    at_w1 = residual + norm + tokens * ffn * p.matmul + hooks.get("feed_forward", 0)
    return max(at_wo, at_rope, at_qkv, at_product, at_w2, at_w1)


def deltanet_forward_bytes(args: LlamaArgs, tokens: int, p: Precision, hooks: dict[str, int]) -> int:
    """Peak bytes inside a Gated DeltaNet mixer for `tokens` tokens (not tensor-parallel): its projections' outputs
    (qkv before and after the conv, z, b, a), the chunked rule's float32 operands repeated to the value heads (q, k,
    v, k and v times beta, the solves' U and W, q and k decayed) with three C x C matrices per chunk and head, the
    gated norm's output and the out projection's, or at the projections the hook's temporaries."""
    keys = args.linear_n_key_heads * args.linear_key_head_dim
    values = args.linear_n_value_heads * args.linear_value_head_dim
    conv, heads, chunk = 2 * keys + values, args.linear_n_value_heads, args.linear_chunk_size
    projections = tokens * (2 * conv + values + 2 * heads) * p.matmul
    per_head = 2 * args.linear_key_head_dim + args.linear_value_head_dim
    rule = tokens * heads * (3 * per_head + 3 * chunk) * FP32 + tokens * values * FP32  # and its output
    out = tokens * values * p.matmul + tokens * args.dim * p.matmul + hooks.get("attention.out_proj", 0)
    return projections + max(hooks.get("attention", 0), rule, out)


def moe_forward_bytes(args: LlamaArgs, tokens: int, p: Precision) -> int:
    """Peak bytes inside an MoE feed-forward for `tokens` tokens (every TP rank routes all of them, the experts being
    replicated): the float32 router probabilities, the routed rows (tokens x k), their gate and up projections and
    product, then the experts' outputs and their unsorted copy."""
    rows = tokens * args.moe_top_k
    router = tokens * args.n_experts * (p.matmul + FP32) + 4 * rows * 8
    at_product = rows * args.dim * p.matmul + 3 * rows * args.moe_ffn_dim * p.matmul
    at_combine = rows * args.moe_ffn_dim * p.matmul + 2 * rows * args.dim * p.matmul
    return router + max(at_product, at_combine)


def hook_temporaries(method: str, targets: list[Target], tokens: int, args: LlamaArgs, layer: int, tp: int,
                     p: Precision) -> dict[str, int]:
    """Per input group with a hook: the temporaries of one call (a rowwise TP input is first gathered)."""
    _, q, _, ffn = _per_rank(args, layer, tp)
    widths = {"attention": args.dim, "attention.wo": q * tp, "feed_forward": args.dim, "feed_forward.w2": ffn * tp,
              "attention.out_proj": args.linear_n_value_heads * args.linear_value_head_dim,
              "moe": args.dim, "moe.shared_expert.w2": args.moe_shared_ffn_dim or 0,  # the shared expert: whole
              # DeepSeek-V3's latent attention and shared experts (no TP: LoRA and pruning refuse it there)
              "attention.q_b_proj": args.q_lora_rank or 0, "attention.kv_b_proj": args.kv_lora_rank,
              "moe.shared_experts": args.dim, "moe.shared_experts.w2": args.moe_ffn_dim * args.moe_shared_experts}
    if args.is_latent:
        widths["attention.wo"] = args.n_heads * args.v_head_dim
    gathered = {"attention.wo": tp > 1, "feed_forward.w2": tp > 1}
    out = {}
    for group in {t.group for t in targets}:
        elements = tokens * widths[group]
        out[group] = hook_bytes(method, elements, p) + (elements * p.matmul if gathered.get(group) else 0)
    return out


def statistics_bytes(method: str, in_features: int) -> int:
    return {"wanda": in_features * FP64, "sparsegpt": in_features * in_features * FP32}.get(method, 0)


def selection_bytes(rows: int, cols: int, per_row: bool) -> int:
    """Choosing the pruned positions of scores [rows, cols]: the bool result plus a sort of rows (values and int64
    indices, chunked) or, per layer, a k-th value (a copy with indices) and three bool masks."""
    numel = rows * cols
    if per_row:
        chunk = min(numel, max(cols, SORT_CHUNK_ELEMENTS // max(1, cols) * cols))
        return numel * BOOL + chunk * (FP32 + INT64)
    return numel * BOOL + numel * (FP32 + INT64) + 3 * numel * BOOL


def linear_pruning_bytes(method: str, cfg: Pruning, out_features: int, in_features: int, p: Precision,
                         gathered: bool) -> int:
    """Peak of pruning one linear: its full weight (gathered when sharded) in fp32, the scores, the selection,
    the mask; SparseGPT adds its column-block buffers and the update of the columns not yet visited."""
    numel = out_features * in_features
    full = numel * p.param if gathered else 0
    fp32_copy = numel * FP32 if (p.param != FP32 or method == "sparsegpt") else 0
    keep = numel * BOOL  # ~pruned
    structured = cfg.pattern != "unstructured"
    if method == "sparsegpt":
        width = min(cfg.blocksize, in_features)
        block = out_features * width
        selection = selection_bytes(out_features, width, per_row=structured)
        pruned = numel * BOOL
        update = numel * FP32  # errors @ factor over the remaining columns
        cast_back = numel * p.param if p.param != FP32 else 0
        return full + fp32_copy + pruned + keep + 3 * block * FP32 + selection + update + cast_back
    per_row = method == "wanda" or structured
    scores = numel * FP32
    # Wanda's |W| lives until |W| x norms exists; the scores then live while the positions are selected.
    selecting = scores + selection_bytes(out_features, in_features, per_row)
    scoring = max(2 * scores if method == "wanda" else scores, selecting)
    return full + fp32_copy + max(scoring, keep)


def outlier_count_bytes(groups: dict[str, list[Target]], p: Precision, gathered: bool) -> tuple[int, str]:
    """(peak, linear) of OWL's outlier count in one block of the dense pass: the block's Wanda statistics and their
    fp32 norms, then per linear its full weight (gathered when sharded), the fp32 scores made from it and the
    comparison with M x their mean."""
    stats = sum(statistics_bytes("wanda", m[0].in_features) + m[0].in_features * FP32 for m in groups.values())
    peak, name = 0, ""
    for target in (t for members in groups.values() for t in members):
        numel = target.module.weight.numel()
        scores = (numel * p.param if gathered else 0) + numel * FP32 + numel * BOOL
        if scores > peak:
            peak, name = scores, target.name
    return stats + peak, name


def prepare_bytes(method: str, in_features: int) -> tuple[int, int]:
    """(transient while preparing, kept while the group's linears are pruned): SparseGPT's Cholesky factors."""
    if method != "sparsegpt":
        return in_features * FP32, in_features * FP32
    square = in_features * in_features * FP32
    return 2 * square + in_features, square + in_features


# ------------------------------------------------------------------------------------------ the plan


def plan_pruning(cfg: Pruning, args: LlamaArgs, dims: ParallelDims, parts: list[nn.Module],
                 p: Precision) -> PruningMemoryPlan:
    """The pass's peak on this rank, for parts built (on the meta device or for real) on this rank's layout."""
    model = parts[0]
    method = build_method(cfg)
    name = cfg.method
    targets, _ = find_targets(model, cfg.skip)
    weights, local_params = weight_bytes(parts)
    all_targets = [t for ts in targets.values() for t in ts]
    masks = sum(_local_numel(t.module.weight) for t in all_targets) * BOOL if cfg.hold_masks else 0
    calibrating = calibrates(cfg)
    owl = cfg.layer_ratios == "owl"  # a first pass through the dense blocks, with Wanda's statistics
    stats_name = "wanda" if owl and name == "magnitude" else name
    per_rank = cfg.nsamples // dims.dp_degree if calibrating else 0
    cache = per_rank * (cfg.seq_len // dims.tp) * args.dim * p.hidden
    tokens = cfg.batch_size * cfg.seq_len
    gathered = dims.fsdp_enabled or dims.dp_replicate_enabled or dims.tp_enabled
    block_gather, largest_gather = _fsdp_gathers(model, dims, p) if calibrating else (0, 0)
    stats_peak, forward_peak, prune_peak, prune_note, count_peak, count_note = 0, 0, 0, "", 0, ""
    for layer, layer_targets in targets.items():
        layer_id = int(layer)
        groups = _groups(layer_targets)
        stats = {g: statistics_bytes(stats_name, members[0].in_features) for g, members in groups.items()}
        if owl:
            count, linear = outlier_count_bytes(groups, p, gathered)
            if count > count_peak:
                count_peak, count_note = count, f"OWL's outlier count of {linear.split('.', 2)[-1]} (dense pass)"
        if calibrating:
            forward = block_gather + max(
                block_forward_bytes(args, layer_id, tokens, dims.tp, p,
                                    hook_temporaries(hooks_of, layer_targets, tokens, args, layer_id, dims.tp, p))
                for hooks_of in {stats_name, "wanda" if owl else stats_name})
            stats_peak = max(stats_peak, sum(stats.values()))
            forward_peak = max(forward_peak, forward)
        remaining = sum(stats.values())
        for group, members in groups.items():
            transient, kept = prepare_bytes(name, members[0].in_features) if method.needs_calibration else (0, 0)
            linear = max(linear_pruning_bytes(name, cfg, *t.module.weight.shape, p, gathered) for t in members)
            phase = max(remaining + transient, remaining - stats[group] + kept + linear)
            if phase > prune_peak:
                prune_peak, prune_note = phase, f"pruning {members[0].name.split('.', 2)[-1]} and its group"
            remaining -= stats[group]
    phases = {f"a batch of {tokens:,} tokens through a block with its hooks"
              + (" (+ the block's FSDP all-gather)" if block_gather else ""): stats_peak + forward_peak,
              prune_note: prune_peak,
              "the largest FSDP all-gather (first forward, embedding)": largest_gather}
    if owl:
        phases[count_note] = count_peak
    phase_note = max(phases, key=phases.get)
    working = phases[phase_note] - stats_peak
    notes = {
        "weights": f"{local_params:,} local parameters x {p.name} (+ buffers)",
        "masks": (f"1 byte per local pruned weight ({len(all_targets)} linears)" if cfg.hold_masks
                  else "not held (pruning.hold_masks = false)"),
        "calibration cache": (f"{per_rank} sequences x {cfg.seq_len // dims.tp} tokens x {args.dim}: one block's "
                              f"inputs, replaced by its outputs" + ("; OWL's dense pass first" if owl else "")
                              if calibrating else "none (magnitude needs no data)"),
        "statistics": {"wanda": "input-channel norms (float64)", "sparsegpt": "fp32 Hessians of one block's inputs",
                       "magnitude": "none"}[stats_name],
        "working": phase_note,
    }
    return PruningMemoryPlan(weights, masks, cache, stats_peak, working, notes)


def _groups(targets: list[Target]) -> dict[str, list[Target]]:
    groups: dict[str, list[Target]] = {}
    for t in targets:
        groups.setdefault(t.group, []).append(t)
    return groups


def _fsdp_gathers(model: nn.Module, dims: ParallelDims, p: Precision) -> tuple[int, int]:
    """(largest block's, largest FSDP group's) all-gather: gathered (TP-local) parameters plus the local copy-in.
    The first forward (FSDP2 picks its root there) and the embedding gather groups other than blocks (the head,
    the embedding, a tied embedding in the root)."""
    if not (dims.fsdp_enabled or dims.dp_replicate_enabled):
        return 0, 0
    shard = dims.dp_shard * dims.cp
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    nested = {id(p) for g in groups if g is not model for p in g.parameters()}
    sizes = {}
    for group in groups:
        owned = [w for w in group.parameters() if group is not model or id(w) not in nested]
        sizes[id(group)] = sum(_local_numel(w) for w in owned) * (shard + 1) * p.matmul
    block = max((sizes.get(id(b), 0) for b in model.layers.values()), default=0)
    return block, max(sizes.values(), default=0)


def precision(cfg: JobConfig, dims: ParallelDims, device_type: str, param_dtype: torch.dtype) -> Precision:
    """Element sizes of a run: FSDP computes in its mixed-precision dtype; without it, autocast makes the matmuls
    (not the hidden states) run in a lower compute dtype."""
    compute = compute_dtype(cfg.training.mixed_precision_param, device_type)
    param = param_dtype.itemsize
    name = str(param_dtype).removeprefix("torch.")
    if dims.fsdp_enabled or dims.dp_replicate_enabled:
        return Precision(param, compute.itemsize, compute.itemsize, name)
    return Precision(param, param, compute.itemsize if compute != torch.float32 else param, name)
