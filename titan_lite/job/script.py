"""What the scripts share (their command line is job/cli.py's ScriptParser): checks of their inputs and output
folders (job/outputs.py writes them), a job config for a model folder, the process group and job plan, and an entry
point whose user errors are one line (exit 2) and whose Ctrl-C is one line (exit 130)."""

import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from titan_lite import distributed as tl_dist
from titan_lite.config import JobConfig, parse_args, validate
from titan_lite.data.datasets import check_has_documents, shards_at
from titan_lite.errors import USER_ERROR, ConfigError, quote_path
from titan_lite.job.outputs import check_replaceable
from titan_lite.job.plan import HF_FLAVOR, JobPlan, plan_job
from titan_lite.metrics.logger import init_logger
from titan_lite.models.hf.config import flavor_of_hf_config

logger = logging.getLogger("titan_lite")
DTYPES = ("auto", "float32", "bfloat16")
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


# ------------------------------------------------------------------------------------------------ inputs


def require_folder(flag: str, path: str, holds: str = "") -> None:
    """ConfigError unless `path` is a folder (holding the file `holds`, when given)."""
    if not Path(path).is_dir():
        raise ConfigError(f"{flag} {quote_path(path)} is not a folder")
    if holds and not (Path(path) / holds).is_file():
        raise ConfigError(f"{flag} '{path}' has no {holds}")


def check_text_data(flag: str, path: str) -> None:
    """A text input (.txt/.jsonl/.json.gz/.parquet file or folder) exists and holds text: one line otherwise,
    before any model is built."""
    if not Path(path).exists():
        raise ConfigError(f"{flag} {quote_path(path)} does not exist")
    check_has_documents(shards_at(Path(path), flag), path, flag)


# ---------------------------------------------------------------------------------------------- outputs


def check_output_folder(flag: str, out: str, inputs: dict[str, str | None]) -> None:
    """Refuse an output folder that is an input, lies inside one, or holds one (replacing it would delete it), and
    one that holds anything titan_lite did not write (job/outputs.py's check_replaceable). Write it with
    job/outputs.py's output_folder."""
    target = Path(out).resolve()
    for name, path in inputs.items():
        if not path:
            continue
        source = Path(path).resolve()
        if target == source or source in target.parents:
            where = "is" if target == source else "is inside"
            raise ConfigError(f"{flag} '{out}' {where} {name} '{path}': write the output to another folder "
                              "(it replaces what is there)")
        if target in source.parents:
            raise ConfigError(f"{flag} '{out}' holds {name} '{path}': replacing it would delete the input")
    check_replaceable(flag, out)


# --------------------------------------------------------------------------------------------- the job


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
        raise ConfigError(f"--hf_assets_path {quote_path(hf_assets_path)} is not a folder")
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


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    tl_dist.shutdown_quietly()
    return code


def run_script(work: Callable[[], object]) -> int:
    """Run a script's work: a ConfigError or a missing file is one line on stderr and exit code 2, Ctrl-C one line
    and exit code 130 (outputs are written whole or not at all, so nothing half-written stays); the process group is
    closed."""
    init_logger()
    try:
        work()
        return 0
    except ConfigError as exc:
        return _fail(str(exc), USER_ERROR)
    except FileNotFoundError as exc:
        return _fail(f"{quote_path(str(exc.filename))} does not exist", USER_ERROR)
    except KeyboardInterrupt:
        return _fail("interrupted (Ctrl-C); no output was written", INTERRUPTED)
    finally:
        tl_dist.shutdown()
