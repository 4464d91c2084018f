"""DRY_RUN=1: plan a full-size job in one CPU process (fake process group, meta model); estimate each rank's memory."""

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# The fake backend's store: torch ships it only under torch.testing (it is what torchtitan's dry run uses too).
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_lite.config.schema import JobConfig
from titan_lite.distributed import compute_dtype
from titan_lite.dtensor import local_tensor
from titan_lite.errors import MISSING_FILES, ConfigError
from titan_lite.job.assembly import build_parts
from titan_lite.job.plan import JobPlan, gather_assets, plan_with_tokenizer
from titan_lite.loss import cross_entropy_sum
from titan_lite.metrics.memory import device_capacity_gib
from titan_lite.models.llama import LlamaArgs
from titan_lite.parallel import memory_estimate as me
from titan_lite.parallel.fsdp import reshard_after_forward
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.parallelize import loss_parallel_enabled
from titan_lite.transforms.pruning.memory_plan import PruningMemoryPlan, plan_pruning, precision
from titan_lite.transforms.sheared import ShearedTransform

DEFAULT_DEVICE_MEMORY_GIB = 80.0
# Mesh dimensions whose shards FSDP gathers; a parameter's other shard dimensions (TP) stay split when gathered.
DATA_PARALLEL_MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "fsdp")


def planned_world_size() -> int:
    return int(os.environ.get("NGPU", 1)) * int(os.environ.get("NNODES", 1))


# ------------------------------------------------------------------------------------ building one rank


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Pretend to be `rank` of `world_size`: collectives are no-ops, so the trainer's code plans as it would run."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def planning_config(cfg: JobConfig) -> JobConfig:
    """The job's config with compile off: torch.compile is lazy, so wrapping would plan nothing more."""
    plan = copy.deepcopy(cfg)
    plan.compile.enable = False
    return plan


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


def layer_policies(part: nn.Module, ac_mode: str, ac_option: str) -> dict[int, str]:
    """Global layer id -> AC policy, read from which blocks parallelize_llama wrapped in a checkpoint."""
    wrapped_policy = me.OP_AC if (ac_mode == "selective" and ac_option == "op") else me.FULL_AC
    return {int(name): wrapped_policy if isinstance(block, CheckpointWrapper) else me.NO_AC
            for name, block in part.layers.items()}


def fsdp_units(part: nn.Module, reshard: bool, head_reshards: bool) -> list[me.FsdpUnit]:
    """Every fully_shard group of a part with the parameters it gathers (those not owned by a nested group)."""
    groups = [(name, m) for name, m in part.named_modules() if isinstance(m, FSDPModule)]
    units = []
    for name, module in groups:
        nested = {id(p) for other_name, other in groups if other is not module and _is_inside(other_name, name)
                  for p in other.parameters()}
        own = [p for p in module.parameters() if id(p) not in nested]
        numel, trainable = sum(map(gathered_numel, own)), sum(gathered_numel(p) for p in own if p.requires_grad)
        if module is part:  # FSDP2 never reshards the root after forward: backward needs it straight away
            resh = False
        elif name in ("norm", "output"):
            resh = head_reshards
        else:
            resh = reshard
        units.append(me.FsdpUnit(name or "root", numel, resh, trainable))
    return units


def _is_inside(inner: str, outer: str) -> bool:
    return outer == "" or inner.startswith(outer + ".")


# ------------------------------------------------------------------------------------ one rank's role


@dataclass
class RolePlan:
    """What one representative rank holds and needs."""

    rank: int
    pp_rank: int
    layers: list[list[int]]  # per part (pipeline stage) on this rank
    has_embeddings: bool
    has_head: bool
    local_params: int
    estimate: me.MemoryEstimate


def compute_bytes(cfg: JobConfig) -> tuple[int, str]:
    """(bytes, name) of the compute dtype on the accelerators a plan targets."""
    dtype = compute_dtype(cfg.training.mixed_precision_param, "cuda")
    return dtype.itemsize, str(dtype).removeprefix("torch.")


def activation_shape(cfg: JobConfig, dims: ParallelDims, microbatch: int, loss_parallel: bool) -> me.ActivationShape:
    c, _ = compute_bytes(cfg)
    return me.ActivationShape(tokens=microbatch * cfg.training.seq_len // dims.cp, compute_bytes=c, tp=dims.tp,
                              cp=dims.cp, loss_parallel=loss_parallel, seq_len=cfg.training.seq_len,
                              fused_rms_norm=True)


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


def estimate_rank(cfg: JobConfig, args: LlamaArgs, dims: ParallelDims, parts: list[nn.Module],
                  pp_rank: int) -> tuple[me.MemoryEstimate, int]:
    """(memory estimate, local parameter count) of the built parts of one rank. Parameters count in the dtype the
    model was built in (training.dtype, or a transform's choice such as a bf16 frozen base); gradients and AdamW's
    two moments exist only for trainable parameters."""
    offloaded = cfg.training.enable_cpu_offload and (dims.fsdp_enabled or dims.dp_replicate_enabled)
    params = [p for part in parts for p in part.parameters()]
    trainable = [p for p in params if p.requires_grad]
    local, local_trainable = sum(map(local_numel, params)), sum(map(local_numel, trainable))
    on_device = 0 if offloaded else 1
    activations, activation_note = estimate_activations(cfg, args, dims, parts, pp_rank)
    buffers, buffer_note = estimate_buffers(cfg, dims, parts, local)
    frozen = f"; {local - local_trainable:,} frozen have none" if local_trainable < local else ""
    notes = {
        "parameters": f"{local:,} local x {dtype_names(params)}" + (" (offloaded to CPU)" if offloaded else ""),
        "gradients": f"{local_trainable:,} trainable, sharded like the parameters, {dtype_names(trainable)}{frozen}",
        "optimizer": f"{cfg.optimizer.name}: 2 x {dtype_names(trainable)} per local trainable parameter",
        "activations": activation_note,
        "buffers": buffer_note,
    }
    grads = on_device * param_bytes(trainable)
    return me.MemoryEstimate(on_device * param_bytes(params), grads, 2 * grads, activations, buffers, notes), local


def estimate_activations(cfg: JobConfig, args: LlamaArgs, dims: ParallelDims, parts: list[nn.Module],
                         pp_rank: int) -> tuple[int, str]:
    """Peak activation bytes of the rank's stages, with the microbatches a pipeline keeps in flight."""
    microbatch, n_micro = microbatching(cfg, dims)
    shape = activation_shape(cfg, dims, microbatch, loss_parallel_enabled(dims, cfg))
    schedule = cfg.parallelism.pipeline_parallel_schedule if dims.pp_enabled else None
    in_flight = me.in_flight_microbatches(schedule, dims.pp, pp_rank, n_micro, len(parts))
    ac = cfg.activation_checkpoint
    stages = [(layer_policies(part, ac.mode, ac.selective_ac_option), part.output is not None) for part in parts]
    seq_note = f"seq {cfg.training.seq_len}" + (f" / cp {dims.cp}" if dims.cp > 1 else "")
    ac_note = ac.mode if ac.mode != "selective" else f"selective {ac.selective_ac_option}"
    note = (f"AC {ac_note}; microbatch {microbatch} x {seq_note}, {in_flight:g} in flight, {compute_bytes(cfg)[1]}"
            + (f", TP {dims.tp} (sequence parallel)" if dims.tp > 1 else ""))
    return me.peak_activation_bytes(args, stages, shape, in_flight), note


def estimate_buffers(cfg: JobConfig, dims: ParallelDims, parts: list[nn.Module], local: int) -> tuple[int, str]:
    """FSDP's gathered parameters and collective buffers; without data parallelism, autocast's weight copies."""
    c, c_name = compute_bytes(cfg)
    if not (dims.fsdp_enabled or dims.dp_replicate_enabled):
        copies = local * c if c < dtype_bytes(cfg.training.dtype) else 0
        return copies, (f"autocast {c_name} weight copies" if copies else "none (no data parallelism)")
    policy = cfg.parallelism.fsdp_reshard_after_forward
    units = [u for part in parts for u in fsdp_units(part, reshard_after_forward(policy, dims.pp_enabled),
                                                       head_reshards=policy == "always")]
    held = sum(u.unsharded_numel for u in units if not u.reshards_after_forward)
    reduce_name = cfg.training.mixed_precision_reduce
    note = (f"FSDP: {held:,} params kept gathered + 2 all-gathers in {c_name} + 2 reduce-scatters in {reduce_name}"
            " (worst neighbouring groups)")
    return me.fsdp_buffer_bytes(units, c, dtype_bytes(reduce_name)), note


def plan_rank(plan: JobPlan, rank: int) -> RolePlan:
    """Build rank `rank`'s parts exactly as the trainer would (on the meta device), then read and estimate them."""
    world = plan.parallel_dims.world_size
    with fake_process_group(rank, world):
        dims = ParallelDims.from_config(plan.cfg.parallelism, world)
        dims.build_mesh("cpu")  # a "cuda" mesh cannot be built on a CPU-only install; placement is identical
        pp_rank = dims.submesh("pp").get_local_rank()
        rank_plan = replace(plan, cfg=planning_config(plan.cfg), parallel_dims=dims)
        parts, _ = build_parts(rank_plan, torch.device("cpu"), cross_entropy_sum)
        estimate, local = estimate_rank(plan.cfg, plan.model_args, dims, parts, pp_rank)
    return RolePlan(rank=rank, pp_rank=pp_rank, layers=[[int(k) for k in p.layers.keys()] for p in parts],
                    has_embeddings=any(p.tok_embeddings is not None for p in parts),
                    has_head=any(p.output is not None for p in parts), local_params=local, estimate=estimate)


def plan_pruning_pass(plan: JobPlan, rank: int = 0) -> PruningMemoryPlan:
    """The one-shot pruning pass's memory on rank `rank` (the 'prune' transform), planned on the meta device for
    an accelerator; every data-parallel rank does the same work."""
    world = plan.parallel_dims.world_size
    with fake_process_group(rank, world):
        dims = ParallelDims.from_config(plan.cfg.parallelism, world)
        dims.build_mesh("cpu")
        parts, _ = build_parts(replace(plan, cfg=planning_config(plan.cfg), parallel_dims=dims), torch.device("cpu"),
                               cross_entropy_sum)
        param_dtype = next(parts[0].layers.parameters()).dtype
        return plan_pruning(plan.cfg.pruning, plan.model_args, dims, parts,
                            precision(plan.cfg, dims, "cuda", param_dtype))


def representative_ranks(dims: ParallelDims) -> list[int]:
    """One rank per pipeline rank (the first of its block): ranks of one pp rank differ only by padding."""
    return [pp_rank * (dims.world_size // dims.pp) for pp_rank in range(dims.pp)]


def ranks_to_plan(dims: ParallelDims) -> list[int]:
    """DRY_RUN_RANK=r plans that one rank; by default every distinct role is planned."""
    chosen = os.environ.get("DRY_RUN_RANK", "")
    if not chosen:
        return representative_ranks(dims)
    if not chosen.isdigit() or int(chosen) >= dims.world_size:
        raise ConfigError(f"DRY_RUN_RANK={chosen!r} is not a rank of the world of {dims.world_size} (NGPU x NNODES)")
    return [int(chosen)]


# ------------------------------------------------------------------------------------ printing


def describe_layers(layers: list[list[int]]) -> str:
    stages = [f"{ids[0]}-{ids[-1]}" if ids else "none" for ids in layers]
    return f"layers {', '.join(stages)} ({sum(len(ids) for ids in layers)})"


def role_lines(role: RolePlan, dims: ParallelDims, capacity_gib: float) -> list[str]:
    ends = [name for name, held in (("embeddings", role.has_embeddings), ("output head", role.has_head)) if held]
    share = dims.world_size // dims.pp
    who = f"rank {role.rank}" + (f" (pp rank {role.pp_rank}; {share} ranks alike)" if dims.pp_enabled
                                 else f" ({dims.world_size} ranks alike)")
    _, verdict = me.verdict(role.estimate, capacity_gib)
    return [f"{who}: {describe_layers(role.layers)}" + (f" + {' + '.join(ends)}" if ends else ""),
            f"  local parameters: {role.local_params:,}", *role.estimate.lines(), f"  verdict: {verdict}"]


def device_memory_gib(cfg: JobConfig) -> float:
    """--dry_run.device_memory_gib, else the visible accelerator's memory, else 80 GiB."""
    if cfg.dry_run.device_memory_gib is not None:
        if cfg.dry_run.device_memory_gib <= 0:
            raise ConfigError(f"'dry_run.device_memory_gib' must be positive, got {cfg.dry_run.device_memory_gib}")
        return float(cfg.dry_run.device_memory_gib)
    if torch.accelerator.is_available():
        capacity = device_capacity_gib(torch.accelerator.current_accelerator())
        if capacity:
            return capacity
    return DEFAULT_DEVICE_MEMORY_GIB


def summary_lines(plan: JobPlan) -> list[str]:
    cfg, dims, t = plan.cfg, plan.parallel_dims, plan.cfg.training
    global_batch = plan.global_batch_size
    return [
        f"DRY RUN of '{cfg.job.config_file}': nothing will be trained",
        f"mesh: {dims.describe()}",
        f"model: {cfg.model.name} {cfg.model.flavor}, {plan.full_param_count():,} parameters, "
        f"{plan.model_args.n_layers} layers" + (f"; transforms: {', '.join(cfg.model.converters)}"
                                                 if cfg.model.converters else ""),
        tokenizer_line(plan),
        f"data: {t.dataset}" + (f" from '{t.dataset_path}'" if t.dataset_path else ""),
        f"batch: local {t.local_batch_size} x data-parallel {dims.dp_degree} x accumulation {plan.grad_accum} "
        f"= global {global_batch} sequences x {t.seq_len} tokens = {global_batch * t.seq_len:,} tokens per step",
        steps_line(plan, global_batch),
    ]


def steps_line(plan: JobPlan, global_batch: int) -> str:
    t = plan.cfg.training
    if t.epochs is not None and not plan.epochs_counted:
        return f"steps: from training.epochs = {t.epochs:g}, counted once the tokenizer and data are there"
    source = f" (training.epochs = {t.epochs:g})" if t.epochs is not None else ""
    return f"steps: {t.steps:,}{source} -> {t.steps * global_batch * t.seq_len:,} tokens"


def tokenizer_line(plan: JobPlan) -> str:
    path = plan.cfg.model.tokenizer_path or plan.cfg.model.hf_assets_path
    if plan.tokenizer is None:
        return (f"tokenizer: not there yet ('{path}'); vocabulary {plan.model_args.vocab_size:,} from flavor "
                f"'{plan.cfg.model.flavor}'")
    line = f"tokenizer: '{path}', {plan.tokenizer.vocab_size:,} tokens"
    if plan.tokenizer.vocab_size * 2 <= plan.model_args.vocab_size:  # larger ones are refused by the plan
        line += (f"\nwarning: the tokenizer's {plan.tokenizer.vocab_size:,} tokens are far fewer than the model's "
                 f"vocabulary of {plan.model_args.vocab_size:,}: is '{path}' this model's tokenizer? (the bundled "
                 "assets/tokenizer is the debug models'; set model.hf_assets_path to the model's folder)")
    return line


def checklist_lines(missing: list[str]) -> list[str]:
    if not missing:
        return []
    return [f"before the real run can start ({len(missing)} missing or unreadable):",
            *(f"  [ ] {problem}" for problem in missing)]


def dry_run(cfg: JobConfig) -> int:
    """Check degrees, shapes and data; build every distinct rank's plan (or DRY_RUN_RANK's) with the trainer's
    code; estimate its memory against the device. Files not downloaded yet (tokenizer, data, weights) become a
    checklist: the plan still prints (the flavor gives the vocabulary size). Returns 0 when the real run could
    start, MISSING_FILES (5) when only files are missing; raises ConfigError (exit 2) when the plan cannot run or
    does not fit."""
    tokenizer, missing = gather_assets(cfg)
    plan = plan_with_tokenizer(cfg, planned_world_size(), tokenizer, count_epochs=not missing)
    capacity = device_memory_gib(cfg)
    sheared = [t.plan_line(plan.model_args) for t in plan.transforms if isinstance(t, ShearedTransform)]
    for line in summary_lines(plan) + sheared + checklist_lines(missing):
        print(line, flush=True)
    print(f"memory per device, estimated against {capacity:.2f} GiB:", flush=True)
    roles = []
    for rank in ranks_to_plan(plan.parallel_dims):
        roles.append(plan_rank(plan, rank))
        print("\n".join(role_lines(roles[-1], plan.parallel_dims, capacity)), flush=True)
    worst = max(roles, key=lambda role: role.estimate.total)
    if "prune" in cfg.model.converters:
        pruning = plan_pruning_pass(plan)
        print(f"one-shot pruning at the start ({cfg.pruning.method} {cfg.pruning.pattern}, {cfg.pruning.nsamples} x "
              f"{cfg.pruning.seq_len} calibration tokens), per device:", flush=True)
        print("\n".join(pruning.lines(capacity)), flush=True)
        if not pruning.fits(capacity):
            raise ConfigError(f"the pruning pass does not fit: it needs an estimated {pruning.peak / me.GIB:.2f} GiB "
                              f"but a device has {capacity:.2f} GiB; lower 'pruning.batch_size' or 'pruning.nsamples', "
                              "or shard over more devices")
    check_fits(worst, capacity)
    peak = worst.estimate.total / me.GIB
    print(f"dry run OK: {plan.parallel_dims.world_size} ranks; largest peak {peak:.2f} GiB on rank {worst.rank}, "
          f"head-room {capacity - peak:.2f} GiB of {capacity:.2f} GiB", flush=True)
    if missing:
        print(f"the real run cannot start yet: {len(missing)} file(s) of the checklist above are missing "
              f"(exit {MISSING_FILES})", flush=True)
        return MISSING_FILES
    return 0


def check_fits(worst: RolePlan, capacity_gib: float) -> None:
    peak = worst.estimate.total / me.GIB
    if peak > capacity_gib:
        raise ConfigError(f"the plan does not fit: rank {worst.rank} needs an estimated {peak:.2f} GiB but a device "
                          f"has {capacity_gib:.2f} GiB ('dry_run.device_memory_gib'); shard more, lower the batch or "
                          f"sequence, or use activation checkpointing")
