"""DRY_RUN=1: validate a full-size job in one CPU process and print its plan; nothing is trained."""

import logging
import os

import torch

from titan_lite.config.schema import JobConfig
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.models.llama import Llama
from titan_lite.parallel.parallel_dims import ParallelDims

logger = logging.getLogger("titan_lite")


def planned_world_size() -> int:
    return int(os.environ.get("NGPU", 1)) * int(os.environ.get("NNODES", 1))


def dry_run(cfg: JobConfig) -> int:
    """Check degrees, tokenizer, data and model on the meta device; print mesh, parameters and batch arithmetic."""
    from titan_lite.train import build_model_args, gradient_accumulation_steps, tokenizer_path

    world = planned_world_size()
    dims = ParallelDims.from_config(cfg.parallelism, world)
    tokenizer = build_tokenizer(tokenizer_path(cfg))
    args = build_model_args(cfg, tokenizer.vocab_size)
    with torch.device("meta"):
        model = Llama(args)
    grad_accum = gradient_accumulation_steps(cfg, dims.dp_degree)
    t = cfg.training
    global_batch = t.local_batch_size * dims.dp_degree * grad_accum
    lines = [
        f"DRY RUN of '{cfg.job.config_file}': nothing will be trained",
        f"mesh: {dims.describe()}",
        f"model: {cfg.model.name} {cfg.model.flavor}, {model.num_params():,} parameters",
        f"tokenizer: '{tokenizer_path(cfg)}', {tokenizer.vocab_size:,} tokens",
        f"data: {t.dataset}" + (f" from '{t.dataset_path}'" if t.dataset_path else ""),
        f"batch: local {t.local_batch_size} x data-parallel {dims.dp_degree} x accumulation {grad_accum} "
        f"= global {global_batch} sequences x {t.seq_len} tokens = {global_batch * t.seq_len:,} tokens per step",
        f"steps: {t.steps} -> {t.steps * global_batch * t.seq_len:,} tokens",
    ]
    for line in lines:
        print(line, flush=True)
    return 0
