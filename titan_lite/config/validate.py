"""Checks a parsed JobConfig for impossible values before any heavy work; each failure is one ConfigError line."""

import dataclasses
from pathlib import Path

from titan_lite.config.manager import iter_options
from titan_lite.errors import ConfigError
from titan_lite.config.schema import JobConfig


def _get(cfg: JobConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_choices_and_unsupported(cfg: JobConfig) -> None:
    for key, f, _ in iter_options():
        value = _get(cfg, key)
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"'{key}' = {value!r} is not one of: {', '.join(choices)}")
        reason = f.metadata.get("unsupported")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if reason and value != default:
            raise ConfigError(f"'{key}' = {value!r} is not supported: {reason}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_ranges(cfg: JobConfig) -> None:
    t, p, v = cfg.training, cfg.parallelism, cfg.validation
    _require(t.steps >= 1, f"'training.steps' must be at least 1, got {t.steps}")
    _require(t.local_batch_size >= 1, f"'training.local_batch_size' must be at least 1, got {t.local_batch_size}")
    _require(t.seq_len >= 2, f"'training.seq_len' must be at least 2, got {t.seq_len}")
    _require(t.global_batch_size == -1 or t.global_batch_size >= 1,
             f"'training.global_batch_size' must be -1 or positive, got {t.global_batch_size}")
    _require(t.gc_freq >= 1, f"'training.gc_freq' must be at least 1, got {t.gc_freq}")
    _require(cfg.optimizer.lr > 0, f"'optimizer.lr' must be positive, got {cfg.optimizer.lr}")
    _require(cfg.optimizer.eps > 0, f"'optimizer.eps' must be positive, got {cfg.optimizer.eps}")
    for name in ("beta1", "beta2"):
        beta = getattr(cfg.optimizer, name)
        _require(0 <= beta < 1, f"'optimizer.{name}' must be in [0, 1), got {beta}")
    _require(cfg.metrics.log_freq >= 1, f"'metrics.log_freq' must be at least 1, got {cfg.metrics.log_freq}")
    _require(cfg.profiling.profile_freq >= 1, f"'profiling.profile_freq' must be at least 1, got {cfg.profiling.profile_freq}")
    check_lr_scheduler(cfg)
    for name in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        degree = getattr(p, name)
        _require(degree >= 1, f"'parallelism.{name}' must be at least 1, got {degree}")
    _require(p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
             f"'parallelism.data_parallel_shard_degree' must be -1 or at least 1, got {p.data_parallel_shard_degree}")
    _require(p.pipeline_parallel_microbatch_size >= 1,
             f"'parallelism.pipeline_parallel_microbatch_size' must be at least 1, got {p.pipeline_parallel_microbatch_size}")
    _require(p.context_parallel_load_balancer in (None, "headtail", "none"),
             f"'parallelism.context_parallel_load_balancer' = {p.context_parallel_load_balancer!r} is not one of: headtail, none")
    if v.enable:
        _require(v.freq >= 1, f"'validation.freq' must be at least 1, got {v.freq}")
        _require(v.local_batch_size >= 1, f"'validation.local_batch_size' must be at least 1, got {v.local_batch_size}")
        _require(v.seq_len >= 2, f"'validation.seq_len' must be at least 2, got {v.seq_len}")
        _require(v.steps == -1 or v.steps >= 1, f"'validation.steps' must be -1 or positive, got {v.steps}")
    check_activation_checkpoint(cfg)
    check_compile(cfg)
    check_checkpoint(cfg)
    check_pipeline(cfg)
    check_context_parallel_seq_len(cfg)
    check_pruning(cfg)


def check_lr_scheduler(cfg: JobConfig) -> None:
    s = cfg.lr_scheduler
    _require(s.warmup_steps >= 0, f"'lr_scheduler.warmup_steps' must be at least 0, got {s.warmup_steps}")
    _require(s.total_steps is None or s.total_steps >= 1, f"'lr_scheduler.total_steps' must be positive, got {s.total_steps}")
    _require(s.decay_ratio is None or 0 <= s.decay_ratio <= 1, f"'lr_scheduler.decay_ratio' must be in [0, 1], got {s.decay_ratio}")
    _require(0 <= s.min_lr_factor <= 1, f"'lr_scheduler.min_lr_factor' must be in [0, 1], got {s.min_lr_factor}")
    if s.name == "greedy":
        _require(s.greedy_factor > 1, f"'lr_scheduler.greedy_factor' must be greater than 1, got {s.greedy_factor}")
        _require(s.greedy_patience >= 1, f"'lr_scheduler.greedy_patience' must be at least 1, got {s.greedy_patience}")
        _require(0 <= s.greedy_smoothing < 1, f"'lr_scheduler.greedy_smoothing' must be in [0, 1), got {s.greedy_smoothing}")
        _require(0 < s.greedy_min_lr_factor <= 1 <= s.greedy_max_lr_factor,
                 "'lr_scheduler.greedy_min_lr_factor' must be in (0, 1] and 'greedy_max_lr_factor' at least 1, "
                 f"got {s.greedy_min_lr_factor} and {s.greedy_max_lr_factor}")
        _require(s.greedy_cooldown >= 0, f"'lr_scheduler.greedy_cooldown' must be at least 0, got {s.greedy_cooldown}")


def check_activation_checkpoint(cfg: JobConfig) -> None:
    ac = cfg.activation_checkpoint
    if ac.mode == "memory_budget":
        raise ConfigError("'activation_checkpoint.mode' = 'memory_budget' is not supported: use none, full or selective")
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        _require(ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1,
                 f"'activation_checkpoint.selective_ac_option' must be 'op' or a positive integer, got {ac.selective_ac_option!r}")


def check_compile(cfg: JobConfig) -> None:
    unknown = [c for c in cfg.compile.components if c not in ("model", "loss")]
    _require(not unknown, f"'compile.components' has {', '.join(map(repr, unknown))}; expected some of: model, loss")


def check_context_parallel_seq_len(cfg: JobConfig) -> None:
    """Context parallel cuts each sequence into equal chunks (2 x CP with head-tail balancing), which sequence
    parallel then splits over TP again."""
    p = cfg.parallelism
    if p.context_parallel_degree == 1:
        return
    _require(p.context_parallel_rotate_method == "allgather",
             f"'parallelism.context_parallel_rotate_method' = {p.context_parallel_rotate_method!r} is not supported: "
             "titan_lite's context parallel all-gathers K/V; use allgather")
    headtail = p.context_parallel_load_balancer not in (None, "none")
    factor = (2 if headtail else 1) * p.context_parallel_degree * p.tensor_parallel_degree
    parts = (["2"] if headtail else []) + [f"context_parallel_degree {p.context_parallel_degree}"]
    if p.tensor_parallel_degree > 1:
        parts.append(f"tensor_parallel_degree {p.tensor_parallel_degree}")
    lengths = [("training.seq_len", cfg.training.seq_len)]
    if cfg.validation.enable:
        lengths.append(("validation.seq_len", cfg.validation.seq_len))
    for key, seq_len in lengths:
        _require(seq_len % factor == 0,
                 f"'{key}' = {seq_len} must be divisible by {factor} ({' x '.join(parts)}) for context parallelism")


def check_pipeline(cfg: JobConfig) -> None:
    """Pipeline checks that need no model: microbatches divide the batches; validation needs a forward-only schedule."""
    p = cfg.parallelism
    if p.pipeline_parallel_degree <= 1:
        return
    mbs = p.pipeline_parallel_microbatch_size
    batches = [("training.local_batch_size", cfg.training.local_batch_size)]
    if cfg.validation.enable:
        batches.append(("validation.local_batch_size", cfg.validation.local_batch_size))
    for key, batch in batches:
        _require(batch % mbs == 0, f"'{key}' {batch} is not a multiple of 'parallelism.pipeline_parallel_microbatch_size' {mbs}")
    _require(not (cfg.validation.enable and p.pipeline_parallel_schedule == "ZBVZeroBubble"),
             "'validation.enable' with 'parallelism.pipeline_parallel_schedule' = 'ZBVZeroBubble' is not supported: "
             "torch's ZBV schedule has no forward-only (eval) mode; use another schedule or disable validation")
    zero_bubble = p.pipeline_parallel_schedule in ("InterleavedZeroBubble", "ZBVZeroBubble")
    _require(not (zero_bubble and cfg.compile.enable and "model" in cfg.compile.components),
             f"'parallelism.pipeline_parallel_schedule' = '{p.pipeline_parallel_schedule}' splits the backward into "
             "input and weight passes, which torch does not support on compiled modules; drop 'model' from "
             "'compile.components' or use another schedule")


def check_pruning(cfg: JobConfig) -> None:
    p = cfg.pruning
    _require(0 < p.sparsity < 1, f"'pruning.sparsity' must be in (0, 1), got {p.sparsity}")
    if p.pattern != "unstructured":
        n, m = (int(v) for v in p.pattern.split(":"))
        _require(abs(p.sparsity - n / m) < 1e-9,
                 f"'pruning.sparsity' = {p.sparsity} contradicts 'pruning.pattern' = '{p.pattern}', which zeroes exactly "
                 f"{n / m:g} of the weights; set sparsity {n / m:g}")
        _require(p.blocksize % m == 0, f"'pruning.blocksize' = {p.blocksize} must be a multiple of {m} for "
                                       f"'pruning.pattern' = '{p.pattern}' (a group never straddles two blocks)")
    for key in ("nsamples", "seq_len", "batch_size", "blocksize"):
        _require(getattr(p, key) >= 1, f"'pruning.{key}' must be at least 1, got {getattr(p, key)}")
    _require(p.percdamp > 0, f"'pruning.percdamp' must be positive, got {p.percdamp}")


def check_checkpoint(cfg: JobConfig) -> None:
    c = cfg.checkpoint
    _require(c.interval >= 1, f"'checkpoint.interval' must be at least 1, got {c.interval}")
    _require(c.keep_latest_k >= 0, f"'checkpoint.keep_latest_k' must be at least 0, got {c.keep_latest_k}")
    allowed = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
    for key in c.exclude_from_loading:
        _require(key in allowed, f"'checkpoint.exclude_from_loading' has '{key}'; expected some of: {', '.join(sorted(allowed))}")
    if c.create_seed_checkpoint:
        _require(c.enable, "'checkpoint.create_seed_checkpoint' = true needs 'checkpoint.enable' = true")
        _require(not c.load_only, "'checkpoint.create_seed_checkpoint' = true contradicts 'checkpoint.load_only' = true")


def check_paths(cfg: JobConfig) -> None:
    t = cfg.training
    if t.dataset_path is not None:
        _require(Path(t.dataset_path).exists(), f"'training.dataset_path' = '{t.dataset_path}' does not exist")
    if cfg.validation.enable and cfg.validation.dataset_path is not None:
        _require(Path(cfg.validation.dataset_path).exists(),
                 f"'validation.dataset_path' = '{cfg.validation.dataset_path}' does not exist")
    if cfg.pruning.dataset_path is not None:
        _require(Path(cfg.pruning.dataset_path).exists(),
                 f"'pruning.dataset_path' = '{cfg.pruning.dataset_path}' does not exist")
    if cfg.checkpoint.initial_load_path is not None:
        _require(Path(cfg.checkpoint.initial_load_path).exists(),
                 f"'checkpoint.initial_load_path' = '{cfg.checkpoint.initial_load_path}' does not exist")


def validate(cfg: JobConfig) -> None:
    """Every value check that needs neither the world size nor the model."""
    check_choices_and_unsupported(cfg)
    check_ranges(cfg)
    check_paths(cfg)
