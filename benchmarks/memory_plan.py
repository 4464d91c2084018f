"""The memory plan measured on CPU: DRY_RUN's per-rank estimate beside the measured peak of live tensors of real
steps of the same config, for every layout and transform it plans; the goal is each within 10%.

    .venv/bin/python -m benchmarks.memory_plan               # quick: the tiny shape, 4 cases (about a minute)
    .venv/bin/python -m benchmarks.memory_plan --all         # tiny and smollm2_135M, every case (10+ minutes)
    .venv/bin/python -m benchmarks.memory_plan --shapes tiny --cases full,fsdp2

A training case runs warm-up steps through titan_lite's Trainer in fresh processes (one per rank), then
one step under the live-tensor count (parameters and optimizer state counted throughout: what a GPU allocator's
peak reports); the estimate is what DRY_RUN prints for that config's largest rank. The Wanda case compares the
pruning pass's own plan with its measured peak.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.cli import parser
from benchmarks.training_run import REPO, Job, estimate_bytes, measure

MIB = 1024**2
TARGET = 0.10


@dataclass(frozen=True)
class Shape:
    flavor: str
    seq_len: int
    batch: int


# debugmodel: the layouts SmolLM2-135M cannot take (TP 2 of its 9 heads; PP of its tied embeddings)
# tiny_moe and debugmodel_moe: Qwen3-MoE's structure (q/k norms, routed experts), the CPU twins of its configs;
# debugmodel_gpt_oss: gpt-oss's eager sink attention (its probabilities saved per head) and biased experts;
# debugmodel_qwen3_5: Qwen3.5's Gated DeltaNet layers (the chunked delta rule, four chunks of 64) and gated attention;
# debugmodel_qwen3_5_moe: the same mixers, every layer routed beside its sigmoid-gated shared expert
SHAPES = {"debugmodel_qwen3_5": Shape("debugmodel_qwen3_5", 256, 2), "tiny_qwen3_5": Shape("tiny_qwen3_5", 64, 2),
          "debugmodel_qwen3_5_moe": Shape("debugmodel_qwen3_5_moe", 256, 2),
          "tiny": Shape("tiny", 64, 2), "smollm2_135M": Shape("smollm2_135M", 512, 2),
          "debugmodel": Shape("debugmodel", 512, 2), "tiny_moe": Shape("tiny_moe", 64, 2),
          "debugmodel_moe": Shape("debugmodel_moe", 256, 2), "debugmodel_gpt_oss": Shape("debugmodel_gpt_oss", 256, 2)}

# name -> (AC mode, processes, overrides); fp32 throughout (what a CPU computes in)
LAYOUTS = {
    "full": ("none", 1, []),
    "ac_op": ("op", 1, []),
    "ac_full": ("full", 1, []),
    "fsdp2": ("none", 2, []),
    "tp2": ("none", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": ("none", 2, ["--parallelism.pipeline_parallel_degree", "2",
                        "--parallelism.pipeline_parallel_microbatch_size", "1"]),
    "lora": ("none", 1, ["--model.converters", "lora", "--lora.rank", "16", "--lora.alpha", "32"]),
    "qlora": ("none", 1, ["--model.converters", "lora", "--lora.rank", "16", "--lora.alpha", "32",
                          "--lora.base_dtype", "nf4"]),
    "float8": ("none", 1, ["--model.converters", "quantize.linear.float8"]),
    # MoE shapes: LoRA on attention and every expert (train_configs/qwen3_30b_a3b_lora.toml's targets), 1 and 2 ranks
    "lora_experts": ("none", 1, ["--model.converters", "lora", "--lora.rank", "16", "--lora.alpha", "32",
                                 "--lora.target_modules", "q_proj,k_proj,v_proj,o_proj,experts"]),
    "lora_experts_fsdp2": ("full", 2, ["--model.converters", "lora", "--lora.rank", "16", "--lora.alpha", "32",
                                       "--lora.target_modules", "q_proj,k_proj,v_proj,o_proj,experts"]),
    # MoE shapes only: the experts split over 2 ranks, every token routed to one rank's experts (the planned worst case)
    "ep2": ("none", 2, ["--parallelism.expert_parallel_degree", "2"]),
}
CASES = [*LAYOUTS, "wanda"]
# The default: one shape, one process and two, a transform (about a minute on 2 idle cores); --all runs the rest.
QUICK = (["tiny"], ["full", "ac_full", "fsdp2", "lora"])
ALL = (["tiny", "smollm2_135M"], CASES)


def missing(case: str) -> str | None:
    """Why a case cannot run in this checkout, or None."""
    from benchmarks.gpu import FLOAT8, nf4_base_available, transform_available

    if case == "qlora" and not nf4_base_available():
        return "QLoRA ('lora.base_dtype = \"nf4\"') is not in this checkout"
    if case == "float8" and not transform_available(FLOAT8):
        return f"the '{FLOAT8}' transform is not in this checkout"
    return None


def job_of(case: str, shape: Shape) -> Job:
    ac, nproc, overrides = LAYOUTS[case]
    # dry_run.device_type cpu: the estimate of the CPU's own step (inert in the training run)
    return Job(shape.flavor, shape.seq_len, batch=shape.batch, ac=ac, precision="float32", nproc=nproc,
               overrides=[*overrides, "--dry_run.device_type", "cpu"], steps=1, warmup=1,
               worst_case_routing="--parallelism.expert_parallel_degree" in overrides)


def wanda_pass(shape: Shape) -> dict:
    """The one-shot Wanda pass's own plan (peak) against its measured peak, in a fresh process."""
    code = ("import json, sys; from benchmarks.memory_plan import wanda_here; "
            f"print('WANDA ' + json.dumps(wanda_here({shape.flavor!r}, {shape.seq_len}, {shape.batch})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WANDA ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": (proc.stdout + proc.stderr).strip().splitlines()[-1:]}
    return json.loads(line[len("WANDA "):])


def wanda_here(flavor: str, seq_len: int, batch: int) -> dict:
    import torch

    from titan_lite import distributed as tl_dist
    from titan_lite.config import parse_args
    from titan_lite.distributed import free_port
    from titan_lite.job.assembly import assemble_model
    from titan_lite.job.plan import plan_job

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as dump, contextlib.redirect_stdout(io.StringIO()):
        cfg = parse_args(["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", flavor,
                          "--model.hf_assets_path", "assets/tokenizer", "--job.dump_folder", dump,
                          "--model.converters", "prune", "--pruning.method", "wanda", "--pruning.nsamples", "8",
                          "--pruning.seq_len", str(seq_len), "--pruning.batch_size", str(batch),
                          "--training.mixed_precision_param", "float32"])
        plan = plan_job(cfg, 1)
        plan.parallel_dims.build_mesh("cpu")
        assemble_model(plan, torch.device("cpu"))
        prune = next(t for t in plan.transforms if t.name == "prune")
        estimate, measured = prune.plan.peak, prune.measured.bytes
    tl_dist.shutdown()
    return {"estimate": estimate, "peak_bytes": measured}


def run_case(case: str, shape_name: str) -> dict:
    shape = SHAPES[shape_name]
    why = missing(case)
    if why:
        return {"skipped": why}
    if case == "wanda":
        return wanda_pass(shape)
    from titan_lite.errors import ConfigError

    job = job_of(case, shape)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            estimate = estimate_bytes(job)
    except ConfigError as error:  # a layout the shape cannot take (TP 2 of SmolLM2's 9 heads)
        return {"skipped": str(error)}
    return measure(job, timeout=900) | {"estimate": estimate}


def row(case: str, shape: str, r: dict) -> str:
    name = f"{shape} {case}".ljust(22)
    if "skipped" in r:
        return f"{name} skipped: {r['skipped']}"
    if "error" in r:
        return f"{name} failed: {r['error']}"
    ratio = r["estimate"] / r["peak_bytes"]
    verdict = "within 10%" if abs(ratio - 1) <= TARGET else "OFF by more than 10%"
    return (f"{name} estimate {r['estimate'] / MIB:9.1f} MiB  measured {r['peak_bytes'] / MIB:9.1f} MiB  "
            f"estimate / measured {ratio:.3f}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.memory_plan")
    p.add_argument("--shapes", help=f"comma list of: {', '.join(SHAPES)} (default: {','.join(QUICK[0])}; with "
                                    f"--all: {','.join(ALL[0])})")
    p.add_argument("--cases", help=f"comma list of: {', '.join(CASES)} (default: {','.join(QUICK[1])}; with --all: "
                                   "every case)")
    p.add_argument("--all", action="store_true", help="every case on the tiny and smollm2_135M shapes (BENCHMARKS.md's "
                                                      "table; 10+ minutes)")
    p.add_argument("--json", default=None, help="also write every result to this file")
    opts = p.parse_args(argv)
    default_shapes, default_cases = ALL if opts.all else QUICK
    shapes = opts.shapes.split(",") if opts.shapes else default_shapes
    cases = opts.cases.split(",") if opts.cases else default_cases
    bad = [s for s in shapes if s not in SHAPES] + [c for c in cases if c not in CASES]
    if bad:
        print(f"error: unknown shape or case {', '.join(bad)}; shapes: {', '.join(SHAPES)}; cases: "
              f"{', '.join(CASES)}", file=sys.stderr)
        return 2
    start, results = time.perf_counter(), []
    print("memory plan: DRY_RUN's estimate of the largest rank against the measured peak of live tensors "
          "(fp32 on CPU)", flush=True)
    for shape in shapes:
        for case in cases:
            r = run_case(case, shape)
            results.append({"shape": shape, "case": case} | r)
            print(row(case, shape, r), flush=True)
    measured = [r for r in results if "estimate" in r and r.get("peak_bytes")]
    within = sum(abs(r["estimate"] / r["peak_bytes"] - 1) <= TARGET for r in measured)
    if opts.json:
        Path = __import__("pathlib").Path
        Path(opts.json).write_text(json.dumps(results, indent=1))
    failed = sum("error" in r for r in results)
    print(f"result: {within}/{len(measured)} estimates within 10% of the measured peak; {failed} failed, "
          f"{sum('skipped' in r for r in results)} skipped; {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
