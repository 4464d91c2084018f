"""What the offline scripts (scripts/prune.py, scripts/eval_ppl.py) share: a job config for a model folder, the
process group and job plan, and an entry point whose user errors are one line (exit 2)."""

import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from titan_lite import distributed as tl_dist
from titan_lite.config import JobConfig, parse_args, validate
from titan_lite.errors import ConfigError
from titan_lite.job.plan import HF_FLAVOR, JobPlan, plan_job
from titan_lite.metrics.logger import init_logger
from titan_lite.models.llama.hf import flavor_of_hf_config

logger = logging.getLogger("titan_lite")
DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(name: str, device_type: str) -> str:
    """'auto': bfloat16 on accelerators, float32 on CPU (where bf16 matmuls are slow)."""
    if name != "auto":
        return name
    return "float32" if device_type == "cpu" else "bfloat16"


def model_flavor(hf_assets_path: str, flavor: str | None) -> str:
    """--flavor, else the flavor that the folder's config.json describes, else 'hf' (the shapes of config.json, e.g.
    a structurally pruned model)."""
    if flavor:
        return flavor
    config = Path(hf_assets_path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"--hf_assets_path '{hf_assets_path}' has no config.json: pass --flavor")
    try:
        return flavor_of_hf_config(config)
    except ConfigError:
        return HF_FLAVOR


def job_config(hf_assets_path: str, flavor: str | None, dtype: str, seq_len: int, tp: int,
               extra: list[str] | None = None) -> JobConfig:
    """A validated job config for one model folder: its tokenizer and shapes, parameters (and compute) in `dtype`,
    no activation checkpointing or compile (nothing is trained)."""
    if not Path(hf_assets_path).is_dir():
        raise ConfigError(f"--hf_assets_path '{hf_assets_path}' is not a folder")
    cfg = parse_args(["--model.hf_assets_path", hf_assets_path, "--model.flavor", model_flavor(hf_assets_path, flavor),
                      "--training.dtype", dtype, "--training.mixed_precision_param", dtype,
                      "--training.seq_len", str(seq_len), "--parallelism.tensor_parallel_degree", str(tp),
                      "--activation_checkpoint.mode", "none", *(extra or [])])
    validate(cfg)
    return cfg


def start_job(cfg: JobConfig) -> tuple[JobPlan, torch.device]:
    """Join the process group (torchrun's, or one of a single process), plan the job, build its mesh."""
    device = tl_dist.local_device()
    tl_dist.init_process_group(device, cfg.comm.init_timeout_seconds)
    if dist.get_rank() != 0:
        logger.setLevel(logging.WARNING)  # progress and results are rank 0's to print
    plan = plan_job(cfg, dist.get_world_size())
    plan.parallel_dims.build_mesh(device.type)
    return plan, device


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def run_script(work: Callable[[], None]) -> int:
    """Run a script's work: a ConfigError is one line on stderr and exit code 2; the process group is closed."""
    init_logger()
    try:
        work()
        return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        tl_dist.shutdown_quietly()
        return 2
    finally:
        tl_dist.shutdown()
