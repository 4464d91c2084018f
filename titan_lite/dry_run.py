"""DRY_RUN=1: plan a full-size job in one CPU process (fake process group, meta model); estimate each rank's memory."""

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

# The fake backend's store: torch ships it only under torch.testing (it is what torchtitan's dry run uses too).
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_lite.config.schema import JobConfig
from titan_lite.data.dataloader import BatchLayout, build_section_source, describe_source, reads_by_index
from titan_lite.data.mixture import build_domain_weights
from titan_lite.errors import MISSING_FILES, ConfigError
from titan_lite.job.assembly import build_parts
from titan_lite.job.estimate import PassPlan, RolePlan, microbatching, plan_role
from titan_lite.job.plan import JobPlan, gather_assets, plan_with_tokenizer
from titan_lite.loss import cross_entropy_sum
from titan_lite.metrics.flops import delta_rule_flops_per_token, model_flops_per_token
from titan_lite.metrics.memory import device_memory_gib
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.rope import rope_attention_factor
from titan_lite.objective import ObjectivePlan, objective_files_problem, plan_objective
from titan_lite.parallel import memory_estimate as me
from titan_lite.parallel.parallel_dims import ParallelDims

T = TypeVar("T")


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


def with_rank_parts(plan: JobPlan, rank: int, use: Callable[[list[nn.Module], ParallelDims], T]) -> T:
    """use(parts, dims) on rank `rank`'s parts, built exactly as the trainer would (on the meta device, in a fake
    process group of the plan's world size)."""
    world = plan.parallel_dims.world_size
    with fake_process_group(rank, world):
        dims = ParallelDims.from_config(plan.cfg.parallelism, world)
        dims.build_mesh("cpu")  # a "cuda" mesh cannot be built on a CPU-only install; placement is identical
        rank_plan = replace(plan, cfg=planning_config(plan.cfg), parallel_dims=dims)
        parts, _ = build_parts(rank_plan, torch.device("cpu"), cross_entropy_sum, schedule=False)
        return use(parts, dims)


def plan_rank(plan: JobPlan, rank: int, objective: ObjectivePlan | None = None) -> RolePlan:
    """Plan rank `rank`'s parts (with what the objective holds: a distillation teacher, a preference reference) and
    the passes run before training."""
    def role(parts: list[nn.Module], dims: ParallelDims) -> RolePlan:
        extra = objective.memory(plan.cfg, dims) if objective is not None else []
        planned = plan_role(plan.cfg, plan.model_args, dims, parts, rank, dims.submesh("pp").get_local_rank(),
                            plan.transforms, extra)
        if objective is not None:
            planned.passes += objective.pass_plans(plan.cfg, dims, planned.estimate)
        return planned
    return with_rank_parts(plan, rank, role)


def plan_passes(plan: JobPlan, rank: int = 0) -> list[PassPlan]:
    """The memory of the passes the transforms run before training, on rank `rank` (scripts that run one)."""
    return plan_rank(plan, rank).passes


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


def summary_lines(plan: JobPlan) -> list[str]:
    cfg, dims, t = plan.cfg, plan.parallel_dims, plan.cfg.training
    global_batch, params = plan.global_batch_size, plan.full_param_count()
    return [
        f"DRY RUN of '{cfg.job.config_file}': nothing will be trained",
        f"mesh: {dims.describe()}",
        f"model: {cfg.model.name} {cfg.model.flavor}, {params:,} parameters, "
        f"{plan.model_args.n_layers} layers" + (f"; transforms: {', '.join(cfg.model.converters)}"
                                                 if cfg.model.converters else ""),
        *rope_lines(plan.model_args),
        tokenizer_line(plan),
        *experts_lines(plan),
        *data_lines(plan, params),
        f"batch: local {t.local_batch_size} x data-parallel {dims.dp_degree} x accumulation {plan.grad_accum} "
        f"= global {global_batch} sequences x {t.seq_len} tokens = {global_batch * t.seq_len:,} tokens per step",
        steps_line(plan, global_batch),
    ]


# Raw text read by one loader process at data-parallel degree 1, tokens/s, by tokenizer back end: measured by
# `python -m benchmarks.data_loading` (BENCHMARKS.md, "Data at scale": a tokenizer.json BPE of 16,384 tokens on
# tiktoken's core and in Python, sequences of 2048, on a 2-core machine shared with other jobs).
RAW_TEXT_TOKENS_PER_S = {"tiktoken": 1_570_000, "python BPE": 298_000}
# What one GPU consumes, for the raw-text warning: 40% MFU of an H100's dense bf16 peak (GPU.md measured 33,539
# tokens/s on the 1B on one H200; this estimate gives about 40,000).
GPU_MFU, GPU_PEAK_FLOPS = 0.4, 989e12


def data_lines(plan: JobPlan, params: int) -> list[str]:
    """The data path of every rank: token files (each rank reads only its own sequences) or raw text (every rank
    reads and tokenizes the whole global batch), the tokens each rank reads per step, and a warning when a raw-text
    loader would deliver fewer tokens per second than its GPUs consume."""
    cfg, dims, t = plan.cfg, plan.parallel_dims, plan.cfg.training
    layout = BatchLayout(t.local_batch_size, 0, dims.dp_degree, plan.grad_accum)
    try:
        source = training_source(cfg, plan)
    except ConfigError:  # data not there yet: the checklist names it
        return [f"data: {t.dataset}" + (f" from '{t.dataset_path}'" if t.dataset_path else "")]
    window = t.seq_len + 1
    if reads_by_index(source):
        most = "up to " if getattr(source, "packing", None) == "one" else ""  # one row per sequence, padded
        return [f"data: {describe_source(source, layout)}; {most}{layout.local_batch * layout.accumulation * window:,} "
                "tokens read per step by each rank"]
    read = layout.global_batch * window
    lines = [f"data: {describe_source(source, layout)}; {read:,} tokens read and tokenized per step by each rank"]
    rate = RAW_TEXT_TOKENS_PER_S.get(plan.tokenizer.backend) if plan.tokenizer is not None else None
    consumed = gpu_tokens_per_s(plan, params) * dims.non_data_parallel_size
    if rate is not None and rate / dims.dp_degree < consumed:
        lines.append(f"warning: raw text at data-parallel degree {dims.dp_degree}: each rank's loader tokenizes the "
                     f"whole global batch, so at the measured {rate:,} tokens/s ({plan.tokenizer.backend}, one "
                     f"process) it delivers about {rate // dims.dp_degree:,} tokens/s to its GPUs, which consume "
                     f"about {consumed:,.0f} ({GPU_MFU:.0%} MFU of an H100): tokenize once with "
                     "scripts/tokenize_data.py and train from the token folder")
    return lines


def training_source(cfg: JobConfig, plan: JobPlan):
    """The training data's source as the trainer builds it (a data mixture's, or the section's); nothing read."""
    if cfg.data_mixture.enable:
        return build_domain_weights(cfg.data_mixture, plan.tokenizer, cfg.training.seq_len, 0,
                                    shuffle=cfg.training.shuffle).source
    return build_section_source(cfg, "training", plan.tokenizer, documents=plan.block_causal)


def gpu_tokens_per_s(plan: JobPlan, params: int) -> float:
    """Tokens per second one GPU trains this model (`params` parameters) at GPU_MFU of GPU_PEAK_FLOPS, every
    parameter trained (a frozen base would be a little faster)."""
    a = plan.model_args
    flops = model_flops_per_token(params - a.inactive_param_count(), a.vocab_size * a.dim, a.attention_shapes(),
                                  plan.cfg.training.seq_len) + delta_rule_flops_per_token(a)
    return GPU_MFU * GPU_PEAK_FLOPS / flops


def rope_lines(args: LlamaArgs) -> list[str]:
    """The long-context RoPE scaling, when there is one (it changes no memory: the cache has the same shape)."""
    if args.rope_scaling_factor is None:
        return []
    kind = args.rope_scaling_type
    original = f" over the original {args.rope_original_max_seq_len:,} positions" if kind != "linear" else ""
    attention = f", attention factor {rope_attention_factor(args):.4f}" if kind == "yarn" else ""
    return [f"rope: {kind} x{args.rope_scaling_factor:g}{original}{attention}; theta {args.rope_theta:g}"]


def experts_lines(plan: JobPlan) -> list[str]:
    """Where an MoE model's experts live and how many routed rows a rank's experts may compute: the capacity the
    memory plan takes (see memory_estimate.routed_rows)."""
    args, dims = plan.model_args, plan.parallel_dims
    if not args.moe_layers:
        return []
    local = args.n_experts // dims.ep
    where = (f"{local} of {args.n_experts} on each rank (ep {dims.ep}), sharded over efsdp {dims.efsdp}"
             if dims.ep_enabled else f"all {args.n_experts} on every rank (no expert parallelism)")
    tokens = microbatching(plan.cfg, dims)[0] * plan.cfg.training.seq_len // dims.cp
    shape = me.ActivationShape(tokens=tokens, compute_bytes=1, tp=dims.tp, cp=dims.cp, ep=dims.ep)
    sent, rows = me.routed_rows(args, shape)
    k = args.moe_top_k
    if not dims.ep_enabled:
        capacity = f"{rows:,} routed rows per layer and microbatch ({tokens:,} tokens x top-{k})"
    else:
        mean = tokens // dims.tp * k
        capacity = (f"each rank sends {sent:,} routed rows per layer and microbatch; its experts compute {mean:,} "
                    f"when balanced and are planned at the worst case, {rows:,} (every token of the {dims.ep} EP "
                    f"ranks choosing {min(k, local)} of this rank's {local} experts)")
    return [f"experts: {len(args.moe_layers)} MoE layers, {where}; {capacity}"]


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
    missing += [problem] if (problem := objective_files_problem(cfg)) else []
    plan = plan_with_tokenizer(cfg, planned_world_size(), tokenizer, count_epochs=not missing)
    objective = plan_objective(plan)
    capacity = device_memory_gib(cfg)
    lines = summary_lines(plan) + plan.transforms.plan_lines(plan.model_args) + (objective.lines if objective else [])
    for line in lines + checklist_lines(missing):
        print(line, flush=True)
    print(f"memory per device, estimated against {capacity:.2f} GiB:", flush=True)
    roles = []
    for rank in ranks_to_plan(plan.parallel_dims):
        roles.append(plan_rank(plan, rank, objective))
        print("\n".join(role_lines(roles[-1], plan.parallel_dims, capacity)), flush=True)
    worst = max(roles, key=lambda role: role.estimate.total)
    for pass_plan in roles[0].passes:  # every data-parallel rank does the same work
        print("\n".join([pass_plan.title, *pass_plan.rows, f"  verdict: {pass_verdict(pass_plan, capacity)}"]),
              flush=True)
        check_pass_fits(pass_plan, capacity)
    check_fits(worst, capacity)
    peak, where = worst.estimate.total / me.GIB, f"rank {worst.rank}"
    largest_pass = max(roles[0].passes, key=lambda p: p.peak, default=None)
    if largest_pass is not None and largest_pass.peak / me.GIB > peak:  # a pass (the rollout) is the largest
        peak, where = largest_pass.peak / me.GIB, f"rank {roles[0].rank}, {largest_pass.name}"
    ranks = plan.parallel_dims.world_size
    print(f"dry run OK: {ranks} rank{'' if ranks == 1 else 's'}; largest peak {peak:.2f} GiB on {where}, "
          f"head-room {capacity - peak:.2f} GiB of {capacity:.2f} GiB", flush=True)
    if missing:
        print(f"the real run cannot start yet: {len(missing)} file(s) of the checklist above are missing "
              f"(exit {MISSING_FILES})", flush=True)
        return MISSING_FILES
    return 0


def pass_verdict(pass_plan: PassPlan, capacity_gib: float) -> str:
    peak = pass_plan.peak / me.GIB
    if peak <= capacity_gib:
        return f"fits: peak {peak:.2f} GiB of {capacity_gib:.2f} GiB, head-room {capacity_gib - peak:.2f} GiB"
    return f"does NOT fit: peak {peak:.2f} GiB exceeds {capacity_gib:.2f} GiB by {peak - capacity_gib:.2f} GiB"


def check_pass_fits(pass_plan: PassPlan, capacity_gib: float) -> None:
    peak = pass_plan.peak / me.GIB
    if peak > capacity_gib:
        raise ConfigError(f"{pass_plan.name} does not fit: it needs an estimated {peak:.2f} GiB but a "
                          f"device has {capacity_gib:.2f} GiB; {pass_plan.advice}")


def check_fits(worst: RolePlan, capacity_gib: float) -> None:
    peak = worst.estimate.total / me.GIB
    if peak > capacity_gib:
        raise ConfigError(f"the plan does not fit: rank {worst.rank} needs an estimated {peak:.2f} GiB but a device "
                          f"has {capacity_gib:.2f} GiB ('dry_run.device_memory_gib'); shard more, lower the batch or "
                          f"sequence, or use activation checkpointing")
