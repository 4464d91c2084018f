"""One training job measured in a fresh process (or one per rank), beside DRY_RUN's estimate of the same config.

The GPU lane (benchmarks/gpu.py) and the CPU memory plan (benchmarks/memory_plan.py) describe a job as a `Job`;
`measure(job)` runs its steps through titan_lite's own Trainer on random tokens and returns tokens/s, MFU and each
rank's peak of tensor bytes over one steady step (the CUDA allocator's `max_memory_allocated` on a GPU, the live
CPU tensors elsewhere); `estimate_bytes(job)` is what DRY_RUN prints as the largest rank's peak for that config.

    .venv/bin/python -m benchmarks.training_run --job '{"flavor": "tiny", "seq_len": 64}'    # one measurement, by hand
"""

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from benchmarks.cli import parser

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "TRAINING_RUN "
RESULTS_ENV = "TITAN_LITE_RUN_RESULTS"  # a folder where each rank writes its figures as rank<N>.json


@dataclass
class Job:
    """A training config by its parts: the flavor (optionally cut to n_layers), shapes, AC, compile, transforms."""

    flavor: str
    seq_len: int
    batch: int = 1
    n_layers: int | None = None  # the flavor cut to its first n_layers (what one GPU holds of a larger model)
    ac: str = "none"  # none, full, op (selective per-op)
    compile: bool = False
    compile_backend: str = "inductor"
    precision: str = "auto"  # training.mixed_precision_param: bf16 autocast on GPUs, float32 on CPU
    overrides: list[str] = field(default_factory=list)  # transforms and anything else, as CLI overrides
    nproc: int = 1  # ranks (FSDP / TP / PP layouts come from the overrides)
    steps: int = 3
    warmup: int = 1
    # MoE: zero router logits, so every token picks the same top-k experts (topk's order of ties), all on one EP rank:
    # the worst case of routing, which DRY_RUN plans for
    worst_case_routing: bool = False

    def flavor_name(self) -> str:
        return self.flavor if self.n_layers is None else f"{self.flavor}_cut{self.n_layers}"

    def cli(self, dump_folder: str) -> list[str]:
        ac = ["--activation_checkpoint.mode", self.ac] if self.ac != "op" else [
            "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
        return ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", self.flavor_name(),
                "--model.hf_assets_path", "assets/tokenizer", "--training.seq_len", str(self.seq_len),
                "--training.local_batch_size", str(self.batch), "--training.mixed_precision_param", self.precision,
                "--training.steps", str(self.steps + self.warmup + 1), "--lr_scheduler.warmup_steps", "0",
                "--optimizer.lr", "1e-4", "--validation.enable=false", "--metrics.enable_tensorboard=false",
                "--job.dump_folder", dump_folder, f"--compile.enable={str(self.compile).lower()}",
                "--compile.backend", self.compile_backend, *ac, *self.overrides]


def register_cut_flavor(job: Job) -> None:
    """Make job.flavor_name() a known flavor in this process (a cut of a larger model keeps its layer shapes)."""
    from titan_lite.models.flavors import FLAVORS, flavor_args

    if job.n_layers is not None and job.flavor_name() not in FLAVORS:
        FLAVORS[job.flavor_name()] = replace(flavor_args(job.flavor), n_layers=job.n_layers)


def job_config(job: Job, dump_folder: str):
    from titan_lite.config import parse_args

    register_cut_flavor(job)
    return parse_args(job.cli(dump_folder))


# ------------------------------------------------------------------------------------------ estimate


def estimate_bytes(job: Job) -> int:
    """DRY_RUN's estimate of the largest rank's peak for this job (its public planning functions, in this process;
    call it where no process group is initialised)."""
    from titan_lite import dry_run
    from titan_lite.job.plan import gather_assets, plan_with_tokenizer

    with tempfile.TemporaryDirectory(prefix="titan_lite_plan_") as dump, contextlib.redirect_stdout(io.StringIO()):
        cfg = job_config(job, dump)
        tokenizer, _ = gather_assets(cfg)
        plan = plan_with_tokenizer(cfg, job.nproc, tokenizer, count_epochs=False)
        totals = [dry_run.plan_rank(plan, rank).estimate.total
                  for rank in dry_run.representative_ranks(plan.parallel_dims)]
    return max(totals)


# ------------------------------------------------------------------------------------------ measuring


def _random_batch(batch: int, seq_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _flops_per_token(trainer, job: Job) -> float:
    from titan_lite.metrics.flops import num_flops_per_token
    from titan_lite.models.decoder import Llama

    args = trainer.plan.model_args
    with torch.device("meta"):
        params = Llama(args).num_params()
    return num_flops_per_token(params, 0 if args.tie_word_embeddings else args.vocab_size * args.dim, args.n_layers,
                               args.n_heads, args.head_dim, job.seq_len)


def run_here(job: Job) -> dict:
    """Train job.warmup + job.steps timed steps in this process (one of the launch's ranks, or alone), then one more
    step measuring the peak of tensor bytes; returns this rank's figures."""
    import logging

    from titan_lite import distributed as tl_dist
    from titan_lite.data.batch import Batch
    from titan_lite.metrics.flops import peak_flops
    from titan_lite.metrics.memory import measure_peak
    from titan_lite.train import Trainer

    logging.getLogger("titan_lite").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="titan_lite_run_") as dump:
        trainer = Trainer(job_config(job, dump))
        if job.worst_case_routing:
            route_every_token_alike(trainer.model_parts)
        vocab = trainer.plan.model_args.vocab_size
        batches = [_random_batch(job.batch, job.seq_len, vocab, seed=1000 * trainer.rank + i) for i in range(4)]
        batches = [Batch(*batch).to(trainer.device) for batch in batches]  # as the trainer's loader does
        times, losses = [], []
        for i in range(job.warmup + job.steps):
            start = time.perf_counter()
            loss, _ = trainer.train_step([batches[i % 4]], i + 1)  # .item() inside: the step has finished
            if i >= job.warmup:
                times.append(time.perf_counter() - start)
                losses.append(loss)
        device = trainer.device
        peak_bytes, source = None, "not measured: the CPU's live-tensor count is a dispatch mode, which compiled " \
                                   "code does not run under"
        if device.type != "cpu" or not job.compile:
            state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            baseline = [p for m in trainer.model_parts for p in m.parameters()] + state
            with measure_peak(device, baseline) as peak:
                trainer.train_step([batches[0]], job.warmup + job.steps + 1)
            peak_bytes, source = peak.bytes, peak.source
        result = {"rank": trainer.rank, "step_s": statistics.median(times), "losses": losses,
                  "peak_bytes": peak_bytes, "peak_source": source,
                  "tokens_per_s": job.batch * job.seq_len / statistics.median(times),
                  "flops_per_token": _flops_per_token(trainer, job),
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        if device.type == "cuda":
            result["peak_flops"] = peak_flops(device)
            result["mfu_pct"] = 100 * result["tokens_per_s"] * result["flops_per_token"] / result["peak_flops"]
        tl_dist.shutdown()
    return result


def route_every_token_alike(model_parts: list) -> None:
    """Zero every MoE router's logits (keeping their gradient path): uniform probabilities, the same top-k for all."""
    from titan_lite.models.parts.router import Router

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, Router):
                module.gate.register_forward_hook(lambda _module, _inputs, logits: logits * 0)


RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def worker_python() -> str:
    """The interpreter a measured job starts with: the environment TITAN_LITE_VENV names (scripts/setup_env.sh's
    setting, whose python run_train.sh's ranks run in) where it holds one, else this one."""
    venv = os.environ.get("TITAN_LITE_VENV")
    python = Path(venv) / "bin" / "python" if venv else None
    return str(python) if python is not None and os.access(python, os.X_OK) else sys.executable


def measure(job: Job, timeout: float = 480, env: dict | None = None) -> dict:
    """run_here(job) in a fresh process (nproc > 1: ranks started as run_train.sh starts one node's, by
    titan_lite.launcher, forked after one import where there is no GPU): every rank's figures, or {"error": line}."""
    launcher = [worker_python()]
    if job.nproc > 1:
        preload = [] if torch.cuda.is_available() else ["--preload"]  # a fork after CUDA starts cannot use it
        launcher += ["-m", "titan_lite.launcher", "--local", str(job.nproc), *preload]
    launcher += ["-m", "benchmarks.training_run", "--job", json.dumps(asdict(job))]
    # a measured job is a job of its own: never the rendezvous of a process group the caller set up
    inherited = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    full_env = dict(inherited, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                    **(env or {}))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="titan_lite_results_") as folder:
        full_env[RESULTS_ENV] = folder  # a file per rank: ranks printing at once interleave on the shared pipe
        try:
            proc = subprocess.run(launcher, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        ranks = [json.loads(f.read_text()) for f in sorted(Path(folder).glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != job.nproc:
        output = (proc.stdout + proc.stderr).strip().splitlines()
        tail = output[-20:]
        last = next((t for t in reversed(tail) if "Error" in t or "error" in t), tail[-1] if tail else "no output")
        return {"error": f"exit {proc.returncode}: {last.strip()}", "log_tail": "\n".join(output[-400:])}
    first = min(ranks, key=lambda r: r["rank"])
    peaks = [r["peak_bytes"] for r in ranks]
    return first | {"peak_bytes": None if None in peaks else max(peaks), "rank_peaks": peaks,
                    "tokens_per_s": first["tokens_per_s"] * _data_parallel_share(job)}


def _data_parallel_share(job: Job) -> float:
    """Ranks whose batches are distinct data (tokens/s counts each token once): FSDP ranks, not TP/PP peers."""
    joined = " ".join(job.overrides)
    split = 1
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        if key in joined:
            split *= int(joined.split(key)[1].split()[0])
    return job.nproc / split


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.training_run")
    p.add_argument("--job", required=True, help="a Job as JSON")
    job = Job(**json.loads(p.parse_args(argv).job))
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = run_here(job)
    if os.environ.get(RESULTS_ENV):
        (Path(os.environ[RESULTS_ENV]) / f"rank{result['rank']}.json").write_text(json.dumps(result))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
