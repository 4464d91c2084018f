"""The job plan: tokenizer, model args, parallel degrees, accumulation and transforms, derived once from the config."""

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_lite.checkpoint.manager import check_source_before_launch
from titan_lite.config.schema import JobConfig
from titan_lite.config.validate import validate
from titan_lite.data.datasets import check_dataset
from titan_lite.data.tokenizer import Tokenizer, build_tokenizer
from titan_lite.errors import ConfigError
from titan_lite.models.llama import Llama, LlamaArgs, flavor_args
from titan_lite.models.llama.hf import check_args_against_hf_config
from titan_lite.parallel.fsdp import check_cpu_offload
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.pipeline import check_pipeline_config
from titan_lite.parallel.tensor_parallel import check_tp_divisibility
from titan_lite.transforms import Transforms, build_transforms


@dataclass
class JobPlan:
    """Everything a run derives from its config before any model exists."""

    cfg: JobConfig
    tokenizer: Tokenizer
    model_args: LlamaArgs
    parallel_dims: ParallelDims
    grad_accum: int
    transforms: Transforms

    @property
    def global_batch_size(self) -> int:
        return self.cfg.training.local_batch_size * self.parallel_dims.dp_degree * self.grad_accum

    def full_param_count(self) -> int:
        """Parameters of the whole (converted) model, counted on the meta device."""
        with torch.device("meta"):
            model = Llama(self.model_args)
        self.transforms.convert(model)
        return model.num_params()


def tokenizer_path(cfg: JobConfig) -> str:
    path = cfg.model.tokenizer_path or cfg.model.hf_assets_path
    if not path:
        raise ConfigError("no tokenizer: set 'model.hf_assets_path' to a folder with tokenizer.model or tokenizer.json")
    return path


def build_model_args(cfg: JobConfig, vocab_size: int) -> LlamaArgs:
    """The flavor's args updated from the config (sequence length) and checked against the tokenizer."""
    try:
        args = flavor_args(cfg.model.flavor)
    except KeyError as exc:
        raise ConfigError(f"'model.flavor': {exc.args[0]}") from None
    args.max_seq_len = max(cfg.training.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0,
                           cfg.pruning.seq_len if "prune" in cfg.model.converters else 0)
    if vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer at '{tokenizer_path(cfg)}' has {vocab_size} tokens but flavor "
                          f"'{cfg.model.flavor}' has vocab_size {args.vocab_size}")
    hf_config = Path(cfg.model.hf_assets_path or "") / "config.json"
    if cfg.model.hf_assets_path and hf_config.is_file():
        check_args_against_hf_config(args, str(hf_config))
    return args


def gradient_accumulation_steps(cfg: JobConfig, dp_degree: int) -> int:
    t = cfg.training
    per_step = t.local_batch_size * dp_degree
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_step:
        raise ConfigError(f"'training.global_batch_size' {t.global_batch_size} is not a multiple of local_batch_size "
                          f"{t.local_batch_size} x data-parallel degree {dp_degree} = {per_step}")
    return t.global_batch_size // per_step


def import_custom_module(cfg: JobConfig) -> None:
    """experimental.custom_import: a module imported before the transforms are built (it may register its own)."""
    name = cfg.experimental.custom_import
    if not name:
        return
    try:
        importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"'experimental.custom_import' = '{name}' cannot be imported: {exc}") from None


def plan_job(cfg: JobConfig, world_size: int) -> JobPlan:
    """The job's plan for `world_size` ranks; every impossible combination is one ConfigError line."""
    tokenizer = build_tokenizer(tokenizer_path(cfg))
    args = build_model_args(cfg, tokenizer.vocab_size)
    p = cfg.parallelism
    check_tp_divisibility(args, p.tensor_parallel_degree)
    if p.pipeline_parallel_degree > 1:
        check_pipeline_config(cfg, args.n_layers, args.tie_word_embeddings)
    dims = ParallelDims.from_config(p, world_size)
    check_cpu_offload(cfg, dims)
    check_seed_checkpoint_layout(cfg, dims)
    grad_accum = gradient_accumulation_steps(cfg, dims.dp_degree)
    import_custom_module(cfg)
    transforms = Transforms(build_transforms(cfg))
    transforms.check(args, dims)
    return JobPlan(cfg, tokenizer, args, dims, grad_accum, transforms)


def check_seed_checkpoint_layout(cfg: JobConfig, dims: ParallelDims) -> None:
    if cfg.checkpoint.create_seed_checkpoint and dims.world_size != 1:
        raise ConfigError(f"'checkpoint.create_seed_checkpoint' needs one process and every parallel degree 1; "
                          f"got {dims.describe()}")


def check_data(cfg: JobConfig) -> None:
    check_dataset(cfg.training.dataset, cfg.training.dataset_path, "training")
    if cfg.validation.enable:
        check_dataset(cfg.validation.dataset, cfg.validation.dataset_path, "validation")


def check_before_launch(cfg: JobConfig, world_size: int) -> JobPlan:
    """Everything run_train.sh checks in one quick process before torchrun starts: a user error is one line."""
    validate(cfg)
    check_data(cfg)
    plan = plan_job(cfg, world_size)
    check_source_before_launch(cfg, plan.model_args)
    return plan
