"""One rank's memory plan: reads the parts built for that rank, adds the transforms' contributions (their storage
formats, extra step memory and the passes they run before training) and returns the plan; the formulas on shapes
live in parallel/memory_estimate.py."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan_lite.config.schema import JobConfig
from titan_lite.distributed import compute_dtype
from titan_lite.dtensor import local_tensor
from titan_lite.job.plan import gradient_accumulation_steps
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parameters import canonical_name
from titan_lite.models.parts.moe import MoE
from titan_lite.parallel import memory_estimate as me
from titan_lite.parallel.compile import compiles_model
from titan_lite.parallel.fsdp import reshard_after_forward
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.parallelize import loss_parallel_enabled
from titan_lite.transforms import PassPlan, PlanContext, PlanItem, Transforms

# Mesh dimensions whose shards FSDP gathers; a parameter's other shard dimensions (TP) stay split when gathered.
DATA_PARALLEL_MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "fsdp", "efsdp")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")


@dataclass
class RolePlan:
    """What one representative rank holds and needs, and the passes its transforms run before training."""

    rank: int
    pp_rank: int
    layers: list[list[int]]  # per part (pipeline stage) on this rank
    has_embeddings: bool
    has_head: bool
    local_params: int
    estimate: me.MemoryEstimate
    passes: list[PassPlan] = field(default_factory=list)


# ------------------------------------------------------------------------------------ reading a built part


def local_numel(param: torch.Tensor) -> int:
    return local_tensor(param).numel()


def gathered_numel(param: torch.Tensor) -> int:
    """Elements after FSDP's all-gather: the global size divided by the non-data-parallel (TP) shard factors."""
    if not isinstance(param, DTensor):
        return param.numel()
    names = param.device_mesh.mesh_dim_names or ()
    factor = 1
    for i, placement in enumerate(param.placements):
        if placement.is_shard() and (i >= len(names) or names[i] not in DATA_PARALLEL_MESH_DIMS):
            factor *= param.device_mesh.size(i)
    return param.numel() // factor


def named_params(parts: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) of every parameter of a rank's parts."""
    return [(canonical_name(n), p) for part in parts for n, p in part.named_parameters()]


def layer_policies(part: nn.Module, ac_mode: str, ac_option: str) -> dict[int, str]:
    """Global layer id -> AC policy, read from which blocks parallelize_llama wrapped in a checkpoint."""
    wrapped_policy = me.OP_AC if (ac_mode == "selective" and ac_option == "op") else me.FULL_AC
    return {int(name): wrapped_policy if isinstance(block, CheckpointWrapper) else me.NO_AC
            for name, block in part.layers.items()}


def fsdp_units(part: nn.Module, reshard: bool, head_reshards: bool, transforms: Transforms | None = None,
               compute_bytes: int = 2) -> list[me.FsdpUnit]:
    """Every fully_shard group of a part with the parameters it gathers (those not owned by a nested group); the
    transforms say which parameters gather in another format than the compute dtype."""
    groups = [(name, m) for name, m in part.named_modules() if isinstance(m, FSDPModule)]
    units = []
    for name, module in groups:
        nested = {id(p) for other_name, other in groups if other is not module and _is_inside(other_name, name)
                  for p in other.parameters()}
        own = [(canonical_name(f"{name}.{n}" if name else n), p) for n, p in module.named_parameters()
               if id(p) not in nested]
        numel = sum(gathered_numel(p) for _, p in own)
        trainable = sum(gathered_numel(p) for _, p in own if p.requires_grad)
        gathered = None
        if transforms is not None:
            gathered = int(sum(gathered_numel(p) * transforms.gathered_bytes(n, p, compute_bytes) for n, p in own))
        if module is part:  # FSDP2 never reshards the root after forward: backward needs it straight away
            resh = False
        elif name in ("norm", "output"):
            resh = head_reshards
        else:
            resh = reshard
        units.append(me.FsdpUnit(name or "root", numel, resh, trainable, gathered))
    return units


def _is_inside(inner: str, outer: str) -> bool:
    return outer == "" or inner.startswith(outer + ".")


# ------------------------------------------------------------------------------------ the job's shapes


def compute_bytes(cfg: JobConfig) -> tuple[int, str]:
    """(bytes, name) of the compute dtype on the device a plan targets (dry_run.device_type)."""
    dtype = compute_dtype(cfg.training.mixed_precision_param, cfg.dry_run.device_type)
    return dtype.itemsize, str(dtype).removeprefix("torch.")


def activation_shape(cfg: JobConfig, dims: ParallelDims, microbatch: int, loss_parallel: bool,
                     args: LlamaArgs | None = None) -> me.ActivationShape:
    c, _ = compute_bytes(cfg)
    return me.ActivationShape(tokens=microbatch * cfg.training.seq_len // dims.cp, compute_bytes=c, tp=dims.tp,
                              cp=dims.cp, loss_parallel=loss_parallel, seq_len=cfg.training.seq_len,
                              fused_rms_norm=True, chunked_loss=chunked_loss(cfg, loss_parallel),
                              document_mask=document_mask_kind(cfg, args), ep=dims.ep,
                              device_type=cfg.dry_run.device_type)


def chunked_loss(cfg: JobConfig, loss_parallel: bool) -> bool:
    """Whether the loss saves the probabilities in the logits' dtype (titan_lite's chunked losses: cross entropy when
    eager and not vocab-sharded; preference tuning's log-probabilities always) rather than a float32 log-softmax."""
    return cfg.training.dataset == "preference" or (not loss_parallel and not loss_compiled(cfg))


def document_mask_kind(cfg: JobConfig, args: LlamaArgs | None) -> str | None:
    """How packed documents attend on the planned device: flex (a FlexAttention block mask, CUDA), spans (causal
    attention per document: eager on a CPU, without context parallel), sdpa (an additive mask), or None (causal)."""
    if args is None or args.attn_mask_type != "block_causal":
        return None
    device, compiled = cfg.dry_run.device_type, compiles_model(cfg.compile)
    if args.attn_type == "flex" and device == "cuda" and cfg.parallelism.context_parallel_degree == 1:
        return "flex"
    if device == "cpu" and not compiled and cfg.parallelism.context_parallel_degree == 1:
        return "spans"
    return "sdpa"


def loss_compiled(cfg: JobConfig) -> bool:
    """Whether the loss runs compiled (F.cross_entropy fused by inductor) rather than titan_lite's chunked one."""
    return cfg.compile.enable and "loss" in cfg.compile.components


def microbatching(cfg: JobConfig, dims: ParallelDims) -> tuple[int, int]:
    """(sequences per microbatch, microbatches per local batch): a pipeline splits the local batch."""
    if not dims.pp_enabled:
        return cfg.training.local_batch_size, 1
    mb = cfg.parallelism.pipeline_parallel_microbatch_size
    return mb, cfg.training.local_batch_size // mb


def dtype_bytes(name: str) -> int:
    return me.FP32 if name == "float32" else 2


def dtype_names(params: list[torch.Tensor]) -> str:
    return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})) or "none"


def param_bytes(params: list[torch.Tensor]) -> int:
    return sum(local_numel(p) * p.element_size() for p in params)


# ------------------------------------------------------------------------------------ the estimate


def estimate_rank(cfg: JobConfig, args: LlamaArgs, dims: ParallelDims, parts: list[nn.Module], pp_rank: int,
                  transforms: Transforms | None = None,
                  extra: Sequence[PlanItem] = ()) -> tuple[me.MemoryEstimate, int]:
    """(memory estimate, local parameter count) of the built parts of one rank. Parameters count in the format the
    transforms store them in (else the dtype the model was built in); gradients and AdamW's two moments exist only
    for trainable parameters; the transforms' extra step memory, and `extra` (the objective's: a teacher), are added
    by category."""
    transforms = transforms if transforms is not None else Transforms([])
    offloaded = cfg.training.enable_cpu_offload and (dims.fsdp_enabled or dims.dp_replicate_enabled)
    named = named_params(parts)
    params = [p for _, p in named]
    trainable = [p for p in params if p.requires_grad]
    local, local_trainable = sum(map(local_numel, params)), sum(map(local_numel, trainable))
    stored = int(sum(local_numel(p) * transforms.param_bytes(n, p) for n, p in named))
    on_device = 0 if offloaded else 1
    activation_peak, activation_note = estimate_activations(cfg, args, dims, parts, pp_rank)
    activations = activation_peak.total
    buffers, buffer_note = estimate_buffers(cfg, dims, parts, local, transforms)
    frozen = f"; {local - local_trainable:,} frozen have none" if local_trainable < local else ""
    formats = dtype_names(params) if stored == param_bytes(params) else f"{stored / max(local, 1):.3g} bytes each"
    notes = {
        "parameters": f"{local:,} local x {formats}" + (" (offloaded to CPU)" if offloaded else ""),
        "gradients": f"{local_trainable:,} trainable, sharded like the parameters, {dtype_names(trainable)}{frozen}",
        "optimizer": f"{cfg.optimizer.name}: 2 x {dtype_names(trainable)} per local trainable parameter",
        "activations": activation_note,
        "buffers": buffer_note,
    }
    grads = on_device * param_bytes(trainable)
    sizes = dict(zip(CATEGORIES, (on_device * stored, grads, 2 * grads, activations, buffers), strict=True))
    ctx = PlanContext(cfg, args, dims, parts, compute_bytes(cfg)[0])
    for item in [*transforms.plan_memory(ctx), *extra]:
        sizes[item.category] += item.nbytes
        notes[item.category] = f"{notes[item.category]}; {item.note}" if notes.get(item.category) else item.note
    one_microbatch = microbatching(cfg, dims)[1] == 1 and gradient_accumulation_steps(cfg, dims.dp_degree) == 1
    # Only the model's own gradients and activations: a transform's extra memory may be alive throughout.
    backward_only = grads + fsdp_reduce_scatters(cfg, dims, parts, transforms)
    apart = me.gradients_apart_from_activations(backward_only, activation_peak) if one_microbatch else 0
    return me.MemoryEstimate(*(sizes[c] for c in CATEGORIES), notes, not_together=apart), local


def estimate_activations(cfg: JobConfig, args: LlamaArgs, dims: ParallelDims, parts: list[nn.Module],
                         pp_rank: int) -> tuple[me.ActivationPeak, str]:
    """Peak activation bytes of the rank's stages, with the microbatches a pipeline keeps in flight."""
    microbatch, n_micro = microbatching(cfg, dims)
    shape = activation_shape(cfg, dims, microbatch, loss_parallel_enabled(dims, cfg), args)
    schedule = cfg.parallelism.pipeline_parallel_schedule if dims.pp_enabled else None
    in_flight = me.in_flight_microbatches(schedule, dims.pp, pp_rank, n_micro, len(parts))
    ac = cfg.activation_checkpoint
    stages = [(layer_policies(part, ac.mode, ac.selective_ac_option), part.output is not None) for part in parts]
    seq_note = f"seq {cfg.training.seq_len}" + (f" / cp {dims.cp}" if dims.cp > 1 else "")
    ac_note = ac.mode if ac.mode != "selective" else f"selective {ac.selective_ac_option}"
    note = (f"AC {ac_note}; microbatch {microbatch} x {seq_note}, {in_flight:g} in flight, {compute_bytes(cfg)[1]}"
            + (f", TP {dims.tp} (sequence parallel)" if dims.tp > 1 else "")
            + (f", block-causal ({shape.document_mask}) {me.document_mask_bytes(args, shape) / me.GIB:.2f} GiB "
               "of mask and RoPE rows per microbatch" if shape.document_mask in ("sdpa", "flex") else "")
            + (", block-causal (attention per document)" if shape.document_mask == "spans" else "")
            + routed_rows_note(args, shape, parts))
    return me.activation_peak(args, stages, shape, in_flight), note


def holds_moe_layer(parts: list[nn.Module]) -> bool:
    return any(isinstance(m, MoE) for part in parts for m in part.modules())


def routed_rows_note(args: LlamaArgs, shape: me.ActivationShape, parts: list[nn.Module]) -> str:
    """The MoE layers' routed rows, and under EP the all-to-all buffers (counted within a block's working set)."""
    if not holds_moe_layer(parts):
        return ""
    sent, rows = me.routed_rows(args, shape)
    if shape.ep == 1:
        return f", MoE: {rows:,} routed rows per layer (tokens x top-k)"
    exchange = me.all_to_all_buffer_bytes(args, shape) / me.GIB
    return (f", MoE: {rows:,} routed rows per layer (worst case of expert parallelism), EP all-to-all {sent:,} rows "
            f"out and up to {rows:,} in, {exchange:.2f} GiB with their regrouping (within a block's working set)")


def estimate_buffers(cfg: JobConfig, dims: ParallelDims, parts: list[nn.Module], local: int,
                     transforms: Transforms | None = None) -> tuple[int, str]:
    """FSDP's gathered parameters and collective buffers; without data parallelism, autocast's weight copies."""
    c, c_name = compute_bytes(cfg)
    if not (dims.fsdp_enabled or dims.dp_replicate_enabled):
        # autocast copies the parameters stored wider than the compute dtype (a transform's packed format is not)
        transforms = transforms if transforms is not None else Transforms([])
        copies = sum(local_numel(p) * c for n, p in named_params(parts) if transforms.param_bytes(n, p) > c)
        return copies, (f"autocast {c_name} weight copies" if copies else "none (no data parallelism)")
    units = data_parallel_units(cfg, dims, parts, transforms)
    held = sum(u.unsharded_numel for u in units if not u.reshards_after_forward)
    reduce_name = cfg.training.mixed_precision_reduce
    formats = c_name if all(u.gathered_bytes in (None, u.unsharded_numel * c) for u in units) else \
        f"{c_name} or the transforms' formats"
    note = (f"FSDP: {held:,} params kept gathered + 2 all-gathers in {formats} + 2 reduce-scatters in {reduce_name}"
            " (worst neighbouring groups)")
    return me.fsdp_buffer_bytes(units, c, dtype_bytes(reduce_name), prefetches(cfg)), note


def prefetches(cfg: JobConfig) -> bool:
    """Whether FSDP2 overlaps the next group's collective with this one's compute (on accelerators' streams; on a
    CPU each all-gather and reduce-scatter completes before the next starts)."""
    return cfg.dry_run.device_type != "cpu"


def data_parallel_units(cfg: JobConfig, dims: ParallelDims, parts: list[nn.Module],
                        transforms: Transforms | None) -> list[me.FsdpUnit]:
    policy = cfg.parallelism.fsdp_reshard_after_forward
    return [u for part in parts for u in fsdp_units(part, reshard_after_forward(policy, dims.pp_enabled),
                                                      head_reshards=policy == "always", transforms=transforms,
                                                      compute_bytes=compute_bytes(cfg)[0])]


def fsdp_reduce_scatters(cfg: JobConfig, dims: ParallelDims, parts: list[nn.Module],
                         transforms: Transforms | None) -> int:
    """Bytes of FSDP's reduce-scatter buffers at their worst (0 without data parallelism)."""
    if not (dims.fsdp_enabled or dims.dp_replicate_enabled):
        return 0
    units = data_parallel_units(cfg, dims, parts, transforms)
    return me.fsdp_reduce_scatter_bytes(units, dtype_bytes(cfg.training.mixed_precision_reduce), prefetches(cfg))


def plan_role(plan_cfg: JobConfig, args: LlamaArgs, dims: ParallelDims, parts: list[nn.Module], rank: int,
              pp_rank: int, transforms: Transforms, extra: Sequence[PlanItem] = ()) -> RolePlan:
    """The plan of one rank from its built parts: the training step's estimate (with the objective's `extra`
    memory) and the transforms' passes."""
    estimate, local = estimate_rank(plan_cfg, args, dims, parts, pp_rank, transforms, extra)
    passes = transforms.pass_plans(PlanContext(plan_cfg, args, dims, parts, compute_bytes(plan_cfg)[0]))
    return RolePlan(rank=rank, pp_rank=pp_rank, layers=[[int(k) for k in p.layers.keys()] for p in parts],
                    has_embeddings=any(p.tok_embeddings is not None for p in parts),
                    has_head=any(p.output is not None for p in parts), local_params=local, estimate=estimate,
                    passes=passes)
