"""The model an lm_eval run evaluates, named by `--model_args`: an HF folder (`pretrained=`, optionally with a PEFT
`adapter=`), or a DCP checkpoint of a run with that run's TOML (`checkpoint=`, `config=`), whose transforms (unmerged
LoRA, pruning masks, ...) are rebuilt as in training. Every process holds the whole model: lm_eval deals requests
to data-parallel ranks, and each rank scores its own."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from titan_lite.config import JobConfig, parse_args, validate
from titan_lite.data.tokenizer import Tokenizer
from titan_lite.errors import ConfigError
from titan_lite.job.inference import assemble_with_checkpoint
from titan_lite.job.plan import plan_job, tokenizer_path
from titan_lite.job.script import DTYPES, job_config, resolve_dtype
from titan_lite.transforms import apply_peft_adapter

MODEL_ARG_KEYS = ("pretrained", "checkpoint", "config", "adapter", "dtype", "max_length")
DEFAULT_MAX_LENGTH = 2048  # lm_eval's HF backend's, for a config.json without max_position_embeddings


@dataclass
class ModelSpec:
    """What `--model_args` names."""

    pretrained: str | None = None
    checkpoint: str | None = None
    config: str | None = None
    adapter: str | None = None
    dtype: str = "auto"
    max_length: int | None = None


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    max_length: int
    description: str


def parse_model_args(values: list[str]) -> ModelSpec:
    """`key=value,key=value` (in one or several arguments) -> a checked ModelSpec; a bad one is one line."""
    fields: dict[str, str] = {}
    for item in (part for value in values for part in value.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value:
            raise ConfigError(f"--model_args: '{item}' is not key=value (keys: {', '.join(MODEL_ARG_KEYS)})")
        if key not in MODEL_ARG_KEYS:
            raise ConfigError(f"--model_args: unknown key '{key}' (expected {', '.join(MODEL_ARG_KEYS)})")
        fields[key] = value.strip()
    spec = ModelSpec(**{k: v for k, v in fields.items() if k != "max_length"})
    if "max_length" in fields:
        if not fields["max_length"].isdigit() or int(fields["max_length"]) < 2:
            raise ConfigError(f"--model_args max_length={fields['max_length']}: expected an integer of at least 2")
        spec.max_length = int(fields["max_length"])
    check_spec(spec)
    return spec


def check_spec(spec: ModelSpec) -> None:
    if bool(spec.pretrained) == bool(spec.checkpoint):
        raise ConfigError("--model_args names one model: pretrained=HF_FOLDER, or checkpoint=STEP_FOLDER,config=TOML")
    if spec.checkpoint and not spec.config:
        raise ConfigError("--model_args checkpoint= needs config=, the TOML of the run that saved it")
    if spec.pretrained and spec.config:
        raise ConfigError("--model_args config= goes with checkpoint=; pretrained= reads the folder's config.json")
    if spec.adapter and not spec.pretrained:
        raise ConfigError("--model_args adapter= goes with pretrained= (a run's adapters come from its checkpoint)")
    if spec.dtype not in DTYPES:
        raise ConfigError(f"--model_args dtype={spec.dtype}: expected one of {', '.join(DTYPES)}")
    for key in ("pretrained", "checkpoint", "adapter"):
        if getattr(spec, key) and not Path(getattr(spec, key)).is_dir():
            raise ConfigError(f"--model_args {key}={getattr(spec, key)}: no such folder")
    if spec.config and not Path(spec.config).is_file():
        raise ConfigError(f"--model_args config={spec.config}: no such file")


def context_length(config_json: Path) -> int | None:
    """max_position_embeddings of a config.json, as lm_eval's HF backend reads it."""
    if not config_json.is_file():
        return None
    value = json.loads(config_json.read_text()).get("max_position_embeddings")
    return int(value) if value else None


def single_process_layout(cfg: JobConfig) -> None:
    """One whole model per process (the parallel degrees of a training run do not apply to evaluation)."""
    p = cfg.parallelism
    p.data_parallel_replicate_degree = p.data_parallel_shard_degree = 1
    p.tensor_parallel_degree = p.pipeline_parallel_degree = p.context_parallel_degree = 1
    cfg.checkpoint.enable = False
    cfg.compile.enable = False
    cfg.activation_checkpoint.mode = "none"


def pretrained_config(spec: ModelSpec, dtype: str) -> tuple[JobConfig, int]:
    max_length = spec.max_length or context_length(Path(spec.pretrained) / "config.json") or DEFAULT_MAX_LENGTH
    extra = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", spec.pretrained]
    cfg = job_config(spec.pretrained, None, dtype, max_length, 1, extra)
    if spec.adapter:
        apply_peft_adapter(cfg, spec.adapter)
        validate(cfg)
    return cfg, max_length


def checkpoint_config(spec: ModelSpec, dtype: str) -> tuple[JobConfig, int]:
    cfg = parse_args(["--job.config_file", spec.config])
    assets = Path(cfg.model.hf_assets_path) / "config.json" if cfg.model.hf_assets_path else Path("/nonexistent")
    max_length = spec.max_length or context_length(assets) or cfg.training.seq_len
    cfg.training.seq_len = max_length
    cfg.training.dtype = cfg.training.mixed_precision_param = dtype
    validate(cfg)  # the run's own settings; then what evaluation switches off (no warning about its keys)
    single_process_layout(cfg)
    return cfg, max_length


def tokenizer_folder(spec: ModelSpec) -> Path:
    """The folder of the model's tokenizer files (tokenizer_config.json with its chat_template, if any)."""
    path = Path(spec.pretrained) if spec.pretrained else Path(tokenizer_path(parse_args(["--job.config_file",
                                                                                           spec.config])))
    return path if path.is_dir() else path.parent


@torch.no_grad()
def load_model(spec: ModelSpec, device: torch.device) -> LoadedModel:
    """The model in eval mode on `device`, its tokenizer and context length (the process group is up)."""
    dtype = resolve_dtype(spec.dtype, device.type)
    cfg, max_length = pretrained_config(spec, dtype) if spec.pretrained else checkpoint_config(spec, dtype)
    plan = plan_job(cfg, 1)
    built = assemble_with_checkpoint(plan, spec.checkpoint, device)
    what = spec.pretrained or spec.checkpoint
    if spec.adapter:
        what += f" with the adapter {spec.adapter}"
    return LoadedModel(built.parts[0].eval(), plan.tokenizer, max_length,
                       f"{what} ({cfg.model.flavor}, {dtype}, context {max_length})")
