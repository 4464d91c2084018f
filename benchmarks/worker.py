"""One measurement in a fresh process: train steps of one implementation on one shape, report one JSON line.

Run by benchmarks/run.py (directly, or under torchrun for FSDP); not meant to be called by hand, but it can be:

    .venv/bin/python -m benchmarks.worker --impl titan_lite --shape debug --steps 10 --warmup 3

With --impl distill it trains the shape with distillation from a teacher (a random HF folder of --teacher's flavor)
and alternates, in this one process, plain steps (cross entropy), distilled steps and the teacher's forward alone:
what the teacher adds to a step against what its forward costs.

With --impl paired it alternates titan_lite's and transformers' steps in this one process instead and prints their
ratio (a check on the separate-process comparison, which also measures each process's allocator behaviour), then
each step's kernel floor (its matmuls and attention kernels replayed alone, benchmarks/kernel_floor.py) and the most
any step running those kernels could lead transformers' by.

The line it prints starts with RESULT_PREFIX: per-step seconds of the timed steps, this process's CPU seconds and
the machine's busy CPU seconds over them (to tell foreign load), peak RSS, tokens per step, FLOPs per token.
"""

import argparse
import dataclasses
import gc
import json
import logging
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.cli import parser
from benchmarks.kernel_floor import floor_summary, record_step
from benchmarks.shapes import SHAPES, Shape
from titan_lite import distributed as tl_dist
from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.config import parse_args
from titan_lite.data.batch import Batch
from titan_lite.dry_run import plan_rank
from titan_lite.job.assembly import assemble_model
from titan_lite.job.plan import plan_job
from titan_lite.job.script import start_job
from titan_lite.metrics.flops import num_flops_per_token, peak_flops
from titan_lite.metrics.memory import measure_peak
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.hf.config import args_to_hf_config
from titan_lite.models.parameters import canonical_name
from titan_lite.objective.base import Objective
from titan_lite.train import Trainer
from titan_lite.transforms.lora.qlora import is_block_linear
from titan_lite.transforms.nf4 import is_nf4

RESULT_PREFIX = "BENCH_RESULT "
PROGRESS_PREFIX = "progress: "  # a line benchmarks.run prints while the run goes on (a long run's steps)
_HF_STEP = "transformers' step"
_LR, _BETAS, _EPS, _WEIGHT_DECAY, _MAX_NORM = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.worker")
    p.add_argument("--impl", choices=["titan_lite", "transformers", "paired", "floor", "matmul", "wanda", "distill"],
                   required=True,
                   help="matmul: the machine's fp32 matmul rate (no shape); wanda: one-shot Wanda 50%% on the shape "
                        "(random weights) against its floor, one forward pass over the same calibration windows; "
                        "paired: titan_lite's and transformers' steps alternating in this one process (--steps "
                        "pairs), so both see the same machine state and the same allocator setting; floor: "
                        "titan_lite's steps (with --lora if given) alternating with replays of the step's kernel "
                        "floor, its matmuls and attention kernels alone")
    p.add_argument("--shape", choices=sorted(SHAPES), default="debug")
    p.add_argument("--batch", type=int, default=None, help="sequences per step on each rank (default: the shape's)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator warm-up)")
    p.add_argument("--compile", action="store_true", help="titan_lite: [compile] enable (model and loss)")
    p.add_argument("--optimizer", default="fused", help="titan_lite: optimizer.implementation")
    p.add_argument("--lora", default=None,
                   help="titan_lite: train LoRA adapters on all seven projections with these [lora] overrides "
                        "(e.g. '--lora.rank 16 --lora.alpha 32') instead of every weight")
    p.add_argument("--overrides", default=None,
                   help="titan_lite: more config overrides, e.g. '--model.converters quantize.linear.float8'")
    p.add_argument("--tensor_peak", action="store_true",
                   help="titan_lite: one more step after the timed ones, reporting the peak bytes of live tensors "
                        "(parameters and optimizer state throughout, plus everything the step allocates): what an "
                        "accelerator's allocator peak measures, without the process's own runtime")
    p.add_argument("--plan", action="store_true",
                   help="titan_lite, one process: also report DRY_RUN's estimated peak of the same run (planned with "
                        "the CPU's float32 compute) and the storage of the frozen block linears against bfloat16")
    p.add_argument("--nsamples", type=int, default=32, help="wanda: calibration windows of the shape's seq_len")
    p.add_argument("--teacher", default=None, help="distill: the teacher's flavor (default: the shape's)")
    p.add_argument("--profile", default=None, help="write a torch.profiler table of 2 steps after the timed ones")
    return p.parse_args(argv)


def random_batch(shape: Shape, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token labels) of shape [batch, seq_len], uniform random token ids."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (shape.batch, shape.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ------------------------------------------------------------------------------------ titan_lite


def titan_lite_overrides(shape: Shape, opts: argparse.Namespace, dump_folder: str) -> list[str]:
    overrides = [
        "--job.config_file", "train_configs/debug_model.toml",  # activation checkpointing off, as in transformers
        "--model.flavor", shape.flavor, "--model.hf_assets_path", "assets/tokenizer",
        "--training.seq_len", str(shape.seq_len), "--training.local_batch_size", str(shape.batch),
        "--training.max_norm", str(_MAX_NORM), "--optimizer.lr", str(_LR), "--optimizer.implementation",
        opts.optimizer, "--optimizer.weight_decay", str(_WEIGHT_DECAY), "--lr_scheduler.warmup_steps", "0",
        "--validation.enable=false", "--metrics.enable_tensorboard=false", "--job.dump_folder", dump_folder,
        f"--compile.enable={str(opts.compile).lower()}",
    ]
    if opts.lora:
        overrides += ["--model.converters", "lora", *shlex.split(opts.lora)]
    overrides += shlex.split(opts.overrides or "")
    return overrides


def titan_lite_step(shape: Shape, opts: argparse.Namespace,
                    dump_folder: str) -> tuple[Callable[[int], float], Trainer]:
    """The trainer's own train_step (token count, forward/backward, clip, optimizer step) on random batches, and the
    trainer (for its state)."""
    trainer = Trainer(parse_args(titan_lite_overrides(shape, opts, dump_folder)))
    vocab = trainer.plan.model_args.vocab_size
    batches = [Batch(*random_batch(shape, vocab, seed=trainer.rank * 1000 + i)) for i in range(4)]

    def step(i: int) -> float:
        loss, _ = trainer.train_step([batches[i % len(batches)]], i + 1)
        return loss
    return step, trainer


def planned_peak_bytes(shape: Shape, opts: argparse.Namespace, dump_folder: str) -> int:
    """DRY_RUN's estimated peak of this run on one rank, planned before the trainer starts (its fake process group
    must not meet the trainer's), with float32 compute as on this CPU."""
    cfg = parse_args([*titan_lite_overrides(shape, opts, dump_folder), "--training.mixed_precision_param", "float32"])
    return plan_rank(plan_job(cfg, 1), 0).estimate.total


def base_storage(trainer: Trainer) -> tuple[int, int]:
    """(bytes the frozen block linears are stored in, their bytes in bfloat16)."""
    stored, bf16 = 0, 0
    for part in trainer.model_parts:
        for name, param in part.named_parameters():
            if is_block_linear(canonical_name(name)) and not param.requires_grad:
                inner = [param.quantized_data, param.quantized_scalers, param.quantization_factor] \
                    if is_nf4(param) else [param]
                stored += sum(t.numel() * t.element_size() for t in inner)
                bf16 += param.numel() * 2
    return stored, bf16


def tensor_peak_bytes(trainer: Trainer, step: Callable[[int], float], i: int) -> int:
    """Peak bytes of live tensors over step i, the parameters and optimizer state counted throughout."""
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with measure_peak(torch.device("cpu"), [p for m in trainer.model_parts for p in m.parameters()] + state) as peak:
        step(i)
    return peak.bytes


# ------------------------------------------------------------------------------------------ distill


def distill_steps(shape: Shape, opts: argparse.Namespace, dump_folder: str) -> dict:
    """Plain steps, distilled steps and the teacher's forward alone, alternating on one trainer (the objective
    switched per step) over the same batches, each round in turn order reversed: per-step seconds of each."""
    teacher_args = flavor_args(opts.teacher or shape.flavor)
    teacher = Llama(teacher_args)
    teacher.init_weights(seed=1)
    folder = os.path.join(dump_folder, "teacher")
    write_hf_folder(dict(teacher.named_parameters()), teacher_args, folder, torch.float32, "assets/tokenizer")
    del teacher
    opts.overrides = f"{opts.overrides or ''} --distill.enable --distill.teacher_path {folder}"
    step, trainer = titan_lite_step(shape, opts, dump_folder)
    runner = trainer.model.runner
    distilled, plain = trainer.objective.objective, Objective(runner.loss_fn)
    batches = [random_batch(shape, trainer.plan.model_args.vocab_size, seed=i)[0] for i in range(4)]

    def with_objective(objective: Objective) -> Callable[[int], float]:
        def run(i: int) -> float:
            trainer.objective.objective = objective
            return step(i)
        return run

    def teacher_forward(i: int) -> float:
        with runner.context():
            distilled.reference(lambda model: runner.logits(model, batches[i % len(batches)], {}))
        return 0.0
    work = {"step_s": with_objective(plain), "distill_step_s": with_objective(distilled),
            "teacher_forward_s": teacher_forward}
    return alternate(work, opts.warmup, opts.steps) | {"teacher_flavor": opts.teacher or shape.flavor}


def alternate(work: dict[str, Callable[[int], object]], warmup: int, steps: int) -> dict:
    """The named steps alternating in one process, each round in the other order after `warmup` untimed rounds: the
    seconds of each step by name, with the wall and own CPU time and the machine's busy time over the timed rounds."""
    for i in range(warmup):
        for fn in work.values():
            fn(i)
    times: dict[str, list[float]] = {name: [] for name in work}
    busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    for i in range(warmup, warmup + steps):
        for name in (list(work) if i % 2 else list(work)[::-1]):
            start = time.perf_counter()
            work[name](i)
            times[name].append(time.perf_counter() - start)
    wall, cpu, busy1 = time.perf_counter() - wall0, time.process_time() - cpu0, machine_busy_seconds()
    return {**times, "losses": [0.0], "wall_s": wall, "own_cpu_s": cpu,
            "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0}


# ------------------------------------------------------------------------------------------ wanda


def wanda_against_floor(shape: Shape, opts: argparse.Namespace, dump_folder: str) -> dict:
    """Seconds of the one-shot Wanda pass (50% unstructured, opts.nsamples windows of the shape's seq_len in
    batches of the shape's batch) and of its floor: one no-grad forward pass over as many windows."""
    cfg = parse_args([
        "--model.flavor", shape.flavor, "--model.hf_assets_path", "assets/tokenizer", "--training.seq_len",
        str(shape.seq_len), "--model.converters", "prune", "--pruning.method", "wanda", "--pruning.sparsity", "0.5",
        "--pruning.nsamples", str(opts.nsamples), "--pruning.seq_len", str(shape.seq_len), "--pruning.batch_size",
        str(shape.batch), "--pruning.hold_masks", "false", "--activation_checkpoint.mode", "none",
        "--job.dump_folder", dump_folder])
    plan, device = start_job(cfg)
    built = assemble_model(plan, device)  # random weights; the prune transform's after_load runs the pass
    prune_s = next(t for t in plan.transforms if t.name == "prune").result.seconds
    model = built.parts[0]
    windows = [random_batch(shape, plan.model_args.vocab_size, seed=i)[0] for i in range(opts.nsamples // shape.batch)]
    busy0, cpu0, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
    with torch.no_grad():
        for tokens in windows:
            model(tokens)
    floor_s = time.perf_counter() - start
    cpu, busy1 = time.process_time() - cpu0, machine_busy_seconds()
    return {"prune_s": prune_s, "floor_s": floor_s, "wall_s": floor_s, "own_cpu_s": cpu, "step_s": [floor_s],
            "losses": [0.0], "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0}


# ---------------------------------------------------------------------------------- transformers


def transformers_step(shape: Shape) -> Callable[[int], float]:
    """LlamaForCausalLM (sdpa, fp32, random init) with foreach AdamW and grad-norm clipping, as HF's Trainer does."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM  # optional: a test/benchmark-only dependency
    except ImportError:
        print("error: transformers is not installed (.venv/bin/pip install transformers); it is needed for the "
              "transformers side of the benchmark", file=sys.stderr)
        sys.exit(2)
    args = shape.args()
    config = LlamaConfig(**args_to_hf_config(args, torch.float32))
    config.use_cache = False
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=_LR, betas=_BETAS, eps=_EPS, weight_decay=_WEIGHT_DECAY, foreach=True)
    # HF shifts labels inside the loss: pass the sequence itself as labels.
    batches = [random_batch(shape, args.vocab_size, seed=i)[0] for i in range(4)]

    def step(i: int) -> float:
        inputs = batches[i % len(batches)]
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, _MAX_NORM, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


# ------------------------------------------------------------------------------------- measuring


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores of the machine spent busy since boot (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def measure(step: Callable[[int], float], steps: int, warmup: int) -> dict:
    for i in range(warmup):
        step(i)
    times, losses = [], []
    busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(warmup, warmup + steps):
        start = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - start)
    wall, cpu, busy1 = time.perf_counter() - wall0, time.process_time() - cpu0, machine_busy_seconds()
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"step_s": times, "losses": losses, "wall_s": wall, "own_cpu_s": cpu,
            "sys_cpu_s": usage1.ru_stime - usage0.ru_stime, "minor_faults": usage1.ru_minflt - usage0.ru_minflt,
            "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0}


def profile_table(step: Callable[[int], float], first: int, path: str) -> None:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(first, first + 2):
            step(i)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    shapes = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40)
    with open(path, "w") as f:
        f.write(table + "\n\n" + shapes)


def alternate_with_floors(steps: dict[str, Callable[[int], float]], opts: argparse.Namespace) -> dict:
    """The named steps alternating in this process, and between them replays of each step's kernel floor (its
    matmuls and attention kernels, recorded from one step after the warm-up); each round in turn order reversed, so
    drift of the machine's speed hits all alike. Returns per-step times, floors and the usage of the timed rounds."""
    gc.collect()
    gc.disable()
    for i in range(opts.warmup):
        for step in steps.values():
            step(i)
    recorded = {name: record_step(lambda step=step: step(opts.warmup)) for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    replays: dict[str, dict[str, list[float]]] = {name: {"matmul": [], "attention": []} for name in steps}

    def replay(name: str, _i: int) -> None:
        for kind in ("matmul", "attention"):
            replays[name][kind].append(recorded[name].replay_seconds(kind))

    def timed_step(name: str, i: int) -> None:
        start = time.perf_counter()
        steps[name](i)
        times[name].append(time.perf_counter() - start)

    busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    for i in range(opts.warmup + 1, opts.warmup + 1 + opts.steps):
        work = [(timed_step, name) for name in steps] + [(replay, name) for name in steps]
        for fn, name in work if i % 2 else work[::-1]:
            fn(name, i)
    wall, cpu, busy1 = time.perf_counter() - wall0, time.process_time() - cpu0, machine_busy_seconds()
    gc.enable()
    return {"times": times, "wall_s": wall, "own_cpu_s": cpu,
            "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
            "floors": {name: floor_summary(recorded[name], r["matmul"], r["attention"])
                       for name, r in replays.items()}}


def paired_steps(shape: Shape, opts: argparse.Namespace, dump_folder: str) -> dict:
    """titan_lite's and transformers' steps alternating in one process, with their kernel floors between them
    (alternate_with_floors). titan_lite's trainer sets the process's allocator (keep_freed_memory), so transformers
    runs with it too; TITAN_LITE_CPU_MALLOC=default leaves glibc's default to both."""
    run = alternate_with_floors({"titan_lite": titan_lite_step(shape, opts, dump_folder)[0],
                                 "transformers": transformers_step(shape)}, opts)
    times, floors = run.pop("times"), run.pop("floors")
    ours_s, theirs_s = statistics.median(times["titan_lite"]), statistics.median(times["transformers"])
    allocator = "glibc's default" if os.environ.get("TITAN_LITE_CPU_MALLOC") == "default" else "titan_lite's"
    print(f"paired in one process ({allocator} allocator setting for both), medians of {opts.steps} alternating "
          f"steps: titan_lite {ours_s:.3f} s, transformers {theirs_s:.3f} s per step: {theirs_s / ours_s:.2f}x",
          flush=True)
    print_floors({"titan_lite's step": floors["titan_lite"], _HF_STEP: floors["transformers"]},
                 {"titan_lite's step": ours_s, _HF_STEP: theirs_s})
    return {"step_s": times["titan_lite"], "transformers_step_s": times["transformers"], "allocator": allocator,
            "kernel_floor": floors} | run


def steps_against_floor(shape: Shape, opts: argparse.Namespace, dump_folder: str) -> dict:
    """titan_lite's steps (LoRA ones with --lora) alternating with replays of their kernel floor."""
    what = "titan_lite's LoRA step" if opts.lora else "titan_lite's step"
    run = alternate_with_floors({what: titan_lite_step(shape, opts, dump_folder)[0]}, opts)
    times, floor = run.pop("times")[what], run.pop("floors")[what]
    print_floors({what: floor}, {what: statistics.median(times)})
    return {"step_s": times, "kernel_floor": floor} | run


def print_floors(floors: dict[str, dict], step_s: dict[str, float]) -> None:
    """Each step's kernel floor; with transformers' among them, the most any step of these kernels could lead by."""
    for name, f in floors.items():
        print(f"kernel floor of {name} (its {f['matmul_calls']} matmuls, {f['matmul_gflops']:.1f} GFLOP, "
              f"replayed alone: {f['matmul_s']:.3f} s, {f['matmul_gflops'] / f['matmul_s']:.0f} GFLOP/s; its "
              f"{f['attention_calls']} attention kernels: {f['attention_s']:.3f} s): {f['floor_s']:.3f} s; the step "
              f"takes {step_s[name]:.3f} s, {step_s[name] / f['floor_s']:.2f}x its floor", flush=True)
    if _HF_STEP in floors:
        floor = min(f["floor_s"] for f in floors.values())
        print(f"the most a step running these kernels could lead transformers' step by: "
              f"{step_s[_HF_STEP] / floor:.2f}x (transformers' step / the lower floor)", flush=True)


def matmul_peak() -> dict:
    """The fp32 matmul rate with this process's threads: the MFU denominator, as the trainer measures it."""
    busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    flops = peak_flops(torch.device("cpu"))
    wall, cpu, busy1 = time.perf_counter() - wall0, time.process_time() - cpu0, machine_busy_seconds()
    foreign = (busy1 - busy0 - cpu) / wall if busy0 is not None and busy1 is not None else 0.0
    return {"flops": flops, "threads": torch.get_num_threads(), "foreign_cores": foreign}


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.impl == "matmul":
        print(RESULT_PREFIX + json.dumps(matmul_peak()), flush=True)
        return 0
    shape = SHAPES[opts.shape] if opts.batch is None else dataclasses.replace(SHAPES[opts.shape], batch=opts.batch)
    shape.args()  # registers the benchmark flavors in this process
    logging.getLogger("titan_lite").setLevel(logging.WARNING)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory(prefix="titan_lite_bench_") as dump_folder:
        if opts.impl == "wanda":
            result = wanda_against_floor(shape, opts, dump_folder)
        elif opts.impl == "paired":
            result = paired_steps(shape, opts, dump_folder)
        elif opts.impl == "floor":
            result = steps_against_floor(shape, opts, dump_folder)
        elif opts.impl == "distill":
            result = distill_steps(shape, opts, dump_folder)
        else:
            trainer, planned = None, None
            if opts.impl == "titan_lite":
                planned = planned_peak_bytes(shape, opts, dump_folder) if opts.plan else None
                step, trainer = titan_lite_step(shape, opts, dump_folder)
            else:
                step = transformers_step(shape)
            gc.collect()
            gc.disable()  # as the trainer's loop does
            result = measure(step, opts.steps, opts.warmup)
            if opts.profile:
                profile_table(step, opts.warmup + opts.steps, opts.profile)
            if opts.tensor_peak and trainer is not None:
                result["peak_tensor_bytes"] = tensor_peak_bytes(trainer, step, opts.warmup + opts.steps + 2)
            if planned is not None:
                result["planned_peak_bytes"] = planned
                result["base_bytes"], result["base_bf16_bytes"] = base_storage(trainer)
            gc.enable()
    a = shape.args()
    result.update(
        impl=opts.impl, shape=shape.name, compile=opts.compile, rank=int(os.environ.get("RANK", "0")), world=world,
        threads=torch.get_num_threads(), tokens_per_step=shape.batch * shape.seq_len * world,
        peak_rss_bytes=peak_rss_bytes(),
        flops_per_token=num_flops_per_token(_param_count(a), 0 if a.tie_word_embeddings else a.vocab_size * a.dim,
                                            a.n_layers, a.n_heads, a.head_dim, shape.seq_len),
    )
    print_results(result)
    if opts.impl in ("titan_lite", "wanda", "paired", "floor", "distill"):
        tl_dist.shutdown()
    return 0


def print_results(result: dict) -> None:
    """Rank 0 prints every rank's result line: ranks printing their own interleave on the shared pipe."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        print("\n".join(RESULT_PREFIX + json.dumps(r) for r in results), flush=True)


def _param_count(args: LlamaArgs) -> int:
    with torch.device("meta"):
        return Llama(args).num_params()


if __name__ == "__main__":
    sys.exit(main())
