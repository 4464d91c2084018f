"""A model to generate from, as the scripts load one: a Hugging Face folder (plus a PEFT adapter), or a run's DCP
checkpoint with that run's config, assembled by the trainer's own code on one device."""

from pathlib import Path

import torch

from titan_lite.checkpoint.manager import CheckpointManager
from titan_lite.checkpoint.resume import plan_initial
from titan_lite.config import JobConfig, parse_args
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import BuiltModel, assemble_model
from titan_lite.job.plan import HF_FLAVOR, JobPlan, plan_job
from titan_lite.models.flavors import FLAVORS
from titan_lite.models.hf.config import check_args_against_hf_config
from titan_lite.transforms import apply_peft_adapter


def flavor_of(folder: str) -> str:
    """The flavor whose shapes match an HF folder's config.json, else 'hf' (config.json's own shape: a pruned model,
    a YaRN fine-tune)."""
    config = Path(folder) / "config.json"
    for name, args in FLAVORS.items():
        try:
            check_args_against_hf_config(args, str(config))
            return name
        except ConfigError as exc:
            if "no such file" in str(exc) or "not valid JSON" in str(exc):
                raise
    return HF_FLAVOR


def model_config(hf: str | None, adapter: str | None, checkpoint: str | None, config: str | None,
                 flavor: str | None = None, tokenizer: str | None = None,
                 overrides: list[str] | None = None) -> JobConfig:
    """The config the model is assembled from: the run's TOML (--checkpoint), or one describing the HF folder
    (plus a PEFT adapter as LoRA with the adapter's settings)."""
    overrides = overrides or []
    if checkpoint:
        if not config:
            raise ConfigError("--checkpoint needs --config, the TOML of the run that saved it")
        cfg = parse_args(["--job.config_file", config, *overrides])
    else:
        if config or overrides:
            raise ConfigError("--config and config overrides go with --checkpoint; --hf reads the folder's config.json")
        cfg = parse_args(["--model.flavor", flavor or flavor_of(hf), "--model.hf_assets_path", hf,
                          "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", hf])
        if adapter:
            apply_peft_adapter(cfg, adapter)
    if tokenizer:
        cfg.model.tokenizer_path = tokenizer
    cfg.parallelism.data_parallel_shard_degree = 1
    cfg.checkpoint.enable = False
    return cfg


def build_model(cfg: JobConfig, checkpoint: str | None, device: torch.device) -> tuple[JobPlan, BuiltModel]:
    """The model through the trainer's assembly; a checkpoint's saved parameters on top of the initial weights
    (an adapter-only checkpoint brings the adapters, the config's initial weights the base)."""
    plan = plan_job(cfg, 1)
    plan.parallel_dims.build_mesh(device.type)
    return plan, assemble_with_checkpoint(plan, checkpoint, device)


def assemble_with_checkpoint(plan: JobPlan, checkpoint: str | None, device: torch.device) -> BuiltModel:
    """One whole model of `plan` on `device` from its initial weights, with a checkpoint's saved parameters on top."""
    loading = plan_initial(plan.cfg, Path(checkpoint) if checkpoint else None)
    built = assemble_model(plan, device, seed=plan.cfg.debug.seed or 0, load=loading)
    if loading.checkpoint is not None:
        manager = CheckpointManager(plan.cfg.checkpoint, loading.checkpoint.parent, built.parts, None, {},
                                    saves_parameter=plan.transforms.saves_parameter)
        manager.load_planned(loading)
    return built
