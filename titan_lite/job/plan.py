"""The job plan: tokenizer, model args, parallel degrees, accumulation and transforms, derived once from the config."""

import importlib
import itertools
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from titan_lite.checkpoint.hf import EXPORT_INSTEAD, EXPORT_WHAT, weight_files
from titan_lite.checkpoint.resume import check_source_before_launch, initial_source
from titan_lite.config.schema import JobConfig
from titan_lite.config.validate import validate
from titan_lite.data.dataloader import build_section_source, samples_per_epoch
from titan_lite.data.datasets import check_dataset, check_enough_tokens, resolve_shards
from titan_lite.data.indexed import check_enough_windows
from titan_lite.data.instruct import InstructionFile, check_instruction_data, count_split_examples
from titan_lite.data.mixture import check_mixture_data
from titan_lite.data.order import data_order
from titan_lite.data.preference import PreferenceFile, check_preference_data
from titan_lite.data.prompts import PromptFile, check_prompt_data
from titan_lite.data.token_files import is_token_folder
from titan_lite.data.tokenizer import Tokenizer, build_tokenizer
from titan_lite.distributed import choose_backend, device_type
from titan_lite.errors import ConfigError
from titan_lite.folders import check_replaceable
from titan_lite.job.rope import apply_rope_settings
from titan_lite.metrics.wandb_writer import check_wandb_installed
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import FLAVORS, flavor_args
from titan_lite.models.hf.config import args_from_hf_config, check_args_against_hf_config, read_hf_config
from titan_lite.models.parameters import weight_count
from titan_lite.parallel.context_parallel import check_sequence_lengths
from titan_lite.parallel.expert_parallel import check_ep_divisibility
from titan_lite.parallel.fsdp import check_cpu_offload
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.pipeline import check_pipeline_config
from titan_lite.parallel.tensor_parallel import check_tp_divisibility
from titan_lite.rl.rewards import Rewards
from titan_lite.rl.rollout import check_rollout_batch
from titan_lite.transforms import Transforms, build_transforms

logger = logging.getLogger(__name__)


@dataclass
class JobPlan:
    """Everything a run derives from its config before any model exists."""

    cfg: JobConfig
    tokenizer: Tokenizer | None  # None only in DRY_RUN before the tokenizer is downloaded
    model_args: LlamaArgs
    parallel_dims: ParallelDims
    grad_accum: int
    transforms: Transforms
    epochs_counted: bool = False  # training.steps was set from training.epochs

    @property
    def block_causal(self) -> bool:
        """Whether packed documents attend only within themselves (the batches then carry document ids)."""
        return self.model_args.attn_mask_type == "block_causal"

    @property
    def global_batch_size(self) -> int:
        return self.cfg.training.local_batch_size * self.parallel_dims.dp_degree * self.grad_accum

    def meta_model(self) -> Llama:
        """The whole (converted) model on the meta device."""
        with torch.device("meta"):
            model = Llama(self.model_args)
        self.transforms.convert(model)
        return model

    def full_param_count(self) -> int:
        """Parameters of the whole (converted) model, counted on the meta device."""
        return self.meta_model().num_params()

    def frozen_matmul_param_count(self) -> int:
        """Frozen parameters other than the (untied) embedding lookup: they cost no weight gradient. Of frozen
        experts only the share a token runs counts (top-k of E)."""
        model = self.meta_model()
        args = self.model_args
        lookup = "" if args.tie_word_embeddings else "tok_embeddings.weight"
        return sum(weight_count(p) * args.moe_top_k // args.n_experts if EXPERT_WEIGHT.search(n) else weight_count(p)
                   for n, p in model.named_parameters() if not p.requires_grad and n != lookup)


EXPERT_WEIGHT = re.compile(r"moe\.experts\.w[123](_\w+)?$")  # a grouped weight, or a transform's packed form of it


def tokenizer_path(cfg: JobConfig) -> str:
    path = cfg.model.tokenizer_path or cfg.model.hf_assets_path
    if not path:
        raise ConfigError("no tokenizer: set 'model.hf_assets_path' to a folder with tokenizer.model or tokenizer.json")
    return path


HF_FLAVOR = "hf"


def hf_config_path(cfg: JobConfig) -> Path | None:
    return Path(cfg.model.hf_assets_path) / "config.json" if cfg.model.hf_assets_path else None


def flavor_or_hf_args(cfg: JobConfig) -> LlamaArgs:
    """The named flavor's args; flavor 'hf' takes the shape from model.hf_assets_path/config.json instead. A named
    flavor next to a config.json is checked against it (floats within a relative 1e-6); then [model.rope]'s settings
    apply (a run may add YaRN to a checkpoint published without it)."""
    args = _flavor_or_hf_args(cfg)
    check_model_name(cfg.model.name, cfg.model.flavor, args)
    return apply_rope_settings(args, cfg.model.rope)


MOE_FAMILY_OF = {"qwen3": "qwen3_moe", "mistral": "mixtral"}
FAMILY_OF_NAME = {"gemma3": "gemma3_text"}  # model.name -> the family (config.json model_type) its flavors have


def check_model_name(name: str, flavor: str, args: LlamaArgs) -> None:
    """model.name qwen3, qwen2 or mistral must name a flavor of that family: torchtitan's Qwen3 TOMLs call Qwen3 8B
    '8B', which is titan_lite's Llama 3.1 8B (a llama name is the default, so it is not checked). Their mixtures of
    experts count as the family (torchtitan's qwen3 trains Qwen3-MoE)."""
    family = FAMILY_OF_NAME.get(name, name)
    if name in ("qwen3", "qwen2", "mistral", "gemma3") and args.family not in (family, MOE_FAMILY_OF.get(name)):
        own = [f for f, a in FLAVORS.items() if a.family == family and not f.startswith(("tiny", "debug"))]
        raise ConfigError(f"'model.name' = '{name}' but 'model.flavor' = '{flavor}' is a {args.family} model; "
                          f"the {name} flavors are {', '.join(own)} (or 'hf' with a {name} config.json)")


def _flavor_or_hf_args(cfg: JobConfig) -> LlamaArgs:
    config = hf_config_path(cfg)
    if cfg.model.flavor == HF_FLAVOR:
        if config is None or not config.is_file():
            raise ConfigError(f"'model.flavor' = 'hf' takes the model shape from a Hugging Face config.json, but "
                              f"'{config or 'model.hf_assets_path'}' does not exist (set 'model.hf_assets_path')")
        return args_from_hf_config(read_hf_config(config), source=str(config))
    try:
        args = flavor_args(cfg.model.flavor)
    except KeyError as exc:
        raise ConfigError(f"'model.flavor': {exc.args[0]} (or 'hf': the shape of model.hf_assets_path/config.json)") \
            from None
    if config is not None and config.is_file():
        check_args_against_hf_config(args, str(config))
    return args


def build_model_args(cfg: JobConfig, vocab_size: int | None, transforms: Transforms | None = None) -> LlamaArgs:
    """The model's args (flavor or config.json) with the longest sequence the run (or a transform's pass) uses,
    checked against the tokenizer's vocabulary (None: no tokenizer yet, DRY_RUN before the download)."""
    args = flavor_or_hf_args(cfg)
    args.attn_type = cfg.model.attn_type or args.attn_type
    # preference pairs and RL's prompt + completion sequences are documents: block_causal unless the config says
    # otherwise (validation refuses causal)
    row_file = ROW_FILES.get(cfg.training.dataset)
    pairs = "block_causal" if row_file is not None and row_file.DOCUMENTS else None
    args.attn_mask_type = cfg.model.attn_mask_type or pairs or args.attn_mask_type
    if cfg.model.router_aux_loss_coef is not None:
        args.router_aux_loss_coef = checked_aux_loss_coef(cfg.model.router_aux_loss_coef, args, cfg.model.flavor)
    if cfg.model.load_balance_coeff is not None:
        args.moe_load_balance_coeff = checked_balance_coeff(cfg.model.load_balance_coeff, args, cfg.model.flavor)
    args.max_seq_len = max(cfg.training.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0,
                           transforms.sequence_length() if transforms is not None else 0)
    if vocab_size is not None and vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer at '{tokenizer_path(cfg)}' has {vocab_size} tokens but flavor "
                          f"'{cfg.model.flavor}' has vocab_size {args.vocab_size}")
    return args


def checked_aux_loss_coef(coef: float, args: LlamaArgs, flavor: str) -> float:
    """[model] router_aux_loss_coef: non-negative, and only for a model with experts (no silent no-op)."""
    if not args.n_experts:
        raise ConfigError(f"'model.router_aux_loss_coef' = {coef} has no effect: flavor '{flavor}' is a dense "
                          f"{args.family} model without experts; drop the setting")
    if coef < 0:
        raise ConfigError(f"'model.router_aux_loss_coef' = {coef} must be at least 0 (0 turns the load-balancing loss "
                          "off)")
    return coef


def checked_balance_coeff(coeff: float, args: LlamaArgs, flavor: str) -> float:
    """[model] load_balance_coeff: non-negative, and only for a model whose routers have a correction bias."""
    if args.moe_router != "sigmoid_group" or not args.n_experts:
        raise ConfigError(f"'model.load_balance_coeff' = {coeff} has no effect: flavor '{flavor}' has no routers with "
                          "a correction bias (DeepSeek-V3's); drop the setting")
    if coeff < 0:
        raise ConfigError(f"'model.load_balance_coeff' = {coeff} must be at least 0 (0 freezes the biases)")
    return coeff


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
    return plan_with_tokenizer(cfg, world_size, build_tokenizer(tokenizer_path(cfg)))


def plan_with_tokenizer(cfg: JobConfig, world_size: int, tokenizer: Tokenizer | None,
                        count_epochs: bool = True) -> JobPlan:
    """plan_job with a tokenizer already loaded, or None (the flavor gives the vocabulary size). With
    training.epochs set (and count_epochs), training.steps becomes the steps those epochs take."""
    import_custom_module(cfg)
    transforms = Transforms(build_transforms(cfg))
    args = build_model_args(cfg, tokenizer.vocab_size if tokenizer is not None else None, transforms)
    p = cfg.parallelism
    check_tp_divisibility(args, p.tensor_parallel_degree)
    check_ep_divisibility(args, p.expert_parallel_degree)
    if p.pipeline_parallel_degree > 1:
        check_pipeline_config(cfg, args.n_layers, args.tie_word_embeddings)
    check_sequence_lengths(cfg)
    dims = ParallelDims.from_config(p, world_size)
    check_cpu_offload(cfg, dims)
    check_seed_checkpoint_layout(cfg, dims)
    grad_accum = gradient_accumulation_steps(cfg, dims.dp_degree)
    if cfg.training.dataset == PromptFile.DATASET:
        check_rollout_batch(cfg, cfg.training.local_batch_size * dims.dp_degree * grad_accum, dims)
    epochs_counted = cfg.training.epochs is not None and count_epochs and tokenizer is not None
    if epochs_counted:
        cfg.training.steps = steps_for_epochs(cfg, tokenizer, cfg.training.local_batch_size * dims.dp_degree
                                              * grad_accum, documents=args.attn_mask_type == "block_causal")
    transforms.check(args, dims)
    return JobPlan(cfg, tokenizer, args, dims, grad_accum, transforms, epochs_counted)


def steps_for_epochs(cfg: JobConfig, tokenizer: Tokenizer, global_batch: int, documents: bool = False) -> int:
    """ceil(training.epochs x samples per epoch / global batch), logged once per process. `documents`: packed
    windows hold whole examples (block_causal), which changes how many windows an epoch has."""
    samples = _counted_samples(cfg, tokenizer, documents)
    steps = max(1, math.ceil(cfg.training.epochs * samples / global_batch))
    if steps != cfg.training.steps:
        logger.info(f"training.epochs = {cfg.training.epochs:g}: {samples:,} samples per epoch / global batch "
                    f"{global_batch} -> {steps:,} steps")
    return steps


def _counted_samples(cfg: JobConfig, tokenizer: Tokenizer, documents: bool) -> int:
    t = cfg.training
    key = (t.dataset, t.dataset_path, t.seq_len, repr(cfg.instruct), repr(cfg.preference), tokenizer_path(cfg),
           documents)
    return _SAMPLE_COUNTS.get(key) or _SAMPLE_COUNTS.setdefault(key, samples_per_epoch(cfg, "training", tokenizer,
                                                                                       documents))


_SAMPLE_COUNTS: dict[tuple, int] = {}  # one count per process: the pre-launch check and the trainer both plan


def check_seed_checkpoint_layout(cfg: JobConfig, dims: ParallelDims) -> None:
    if cfg.checkpoint.create_seed_checkpoint and dims.world_size != 1:
        raise ConfigError(f"'checkpoint.create_seed_checkpoint' needs one process and every parallel degree 1; "
                          f"got {dims.describe()}")


def check_prompt_rows(cfg: JobConfig, section: str, tokenizer: Tokenizer | None = None) -> None:
    """Every prompt of the split reads and fits, and every reward function can score its rows."""
    Rewards(cfg.grpo).check_rows(check_prompt_data(cfg, section, tokenizer))


# The datasets of rows, by name (each file class names its own), and the check each runs before launch.
ROW_FILES = {f.DATASET: f for f in (InstructionFile, PreferenceFile, PromptFile)}
ROW_CHECKS = {InstructionFile.DATASET: check_instruction_data, PreferenceFile.DATASET: check_preference_data,
              PromptFile.DATASET: check_prompt_rows}


def check_section_data(cfg: JobConfig, section: str, tokenizer: Tokenizer | None = None) -> None:
    """The data of [training] or [validation] is there and its first document or example reads (and renders with
    the chat template, which sees the tokenizer's special tokens)."""
    s = getattr(cfg, section)
    if s.dataset in ROW_CHECKS:
        ROW_CHECKS[s.dataset](cfg, section, tokenizer)
    elif is_token_folder(s.dataset_path):
        build_section_source(cfg, section, tokenizer)  # opening the files checks them, and the tokenizer
    else:
        check_dataset(s.dataset, s.dataset_path, section)
        data_order(cfg, section, countable=False, where=f"'{section}.dataset_path' = '{s.dataset_path or s.dataset}'")


def check_training_data(cfg: JobConfig, tokenizer: Tokenizer | None = None) -> None:
    """[training]'s dataset, or every domain of [data_mixture] when it replaces it."""
    if cfg.data_mixture.enable:
        check_mixture_data(cfg.data_mixture, cfg.training.shuffle)
    else:
        check_section_data(cfg, "training", tokenizer)


def check_validation_examples(cfg: JobConfig, plan: "JobPlan") -> None:
    """Instruction validation holds one full batch (validation.local_batch_size on every data-parallel rank): the
    pass drops a partial last batch, so fewer would measure nothing (a NaN loss). Packed, it counts sequences."""
    dp_degree = plan.parallel_dims.dp_degree
    needed = cfg.validation.local_batch_size * dp_degree
    packing = cfg.preference.packing if cfg.validation.dataset == "preference" else cfg.instruct.packing
    what = "packed sequences" if packing else ("pairs" if cfg.validation.dataset == "preference" else "examples")
    if packing or cfg.validation.dataset == "preference":
        source = build_section_source(cfg, "validation", plan.tokenizer, infinite=False, documents=plan.block_causal)
        found = sum(1 for _ in itertools.islice(source.samples(), needed))
    else:
        found = count_split_examples(cfg, "validation", needed)
    if found < needed:
        where = cfg.validation.dataset_path or f"the held-out split of {cfg.training.dataset_path}"
        raise ConfigError(f"validation on '{where}' has {found} {what}: fewer than one batch of "
                          f"'validation.local_batch_size' = {cfg.validation.local_batch_size} x {dp_degree} "
                          "data-parallel rank(s); lower it, or add validation data")


def check_data_volume(cfg: JobConfig, plan: "JobPlan") -> None:
    """Packed training and validation data hold at least one window per data-parallel rank (instruction data pads
    each example instead; a data mixture draws windows from whichever domain has them)."""
    if plan.tokenizer is None:
        return
    for section in ("training", "validation") if cfg.validation.enable else ("training",):
        s = getattr(cfg, section)
        if section == "validation" and s.dataset in ("instruct", "preference"):
            check_validation_examples(cfg, plan)
        if s.dataset in ROW_FILES or (section == "training" and cfg.data_mixture.enable):
            continue
        where = s.dataset_path if s.dataset_path is not None else s.dataset
        if is_token_folder(s.dataset_path):
            check_enough_windows(build_section_source(cfg, section, plan.tokenizer), plan.parallel_dims.dp_degree,
                                 f"{section}.dataset_path")
            continue
        check_enough_tokens(resolve_shards(s.dataset, s.dataset_path, section), plan.tokenizer, s.seq_len,
                            plan.parallel_dims.dp_degree, where, f"{section}.dataset_path")


def check_data(cfg: JobConfig) -> None:
    check_training_data(cfg)
    if cfg.validation.enable:
        check_section_data(cfg, "validation")


def check_initial_weights(cfg: JobConfig) -> None:
    """The initial weights a run starts from (when it does not resume) are there: the HF safetensors files, or a
    DCP folder with its metadata (their shapes are checked by check_source_before_launch)."""
    source = initial_source(cfg)
    if source is None:
        return
    kind, path = source
    if kind == "hf":
        weight_files(path)
    elif not path.exists():
        raise ConfigError(f"'checkpoint.initial_load_path' = '{path}' does not exist")
    elif not (path / ".metadata").is_file():
        raise ConfigError(f"'checkpoint.initial_load_path' = '{path}' is not a DCP checkpoint (no .metadata file)")


T = TypeVar("T")


def _noting(problems: list[str], check: Callable[[], T]) -> T | None:
    try:
        return check()
    except ConfigError as exc:
        problems.append(str(exc))
        return None


def gather_assets(cfg: JobConfig) -> tuple[Tokenizer | None, list[str]]:
    """(the tokenizer, one line per missing or unreadable file the run reads: tokenizer, training and validation
    data, initial weights). The launch refuses the first; DRY_RUN lists them all and plans anyway."""
    problems: list[str] = []
    tokenizer = _noting(problems, lambda: build_tokenizer(tokenizer_path(cfg)))
    _noting(problems, lambda: check_training_data(cfg, tokenizer))
    if cfg.validation.enable:
        _noting(problems, lambda: check_section_data(cfg, "validation", tokenizer))
    _noting(problems, lambda: check_initial_weights(cfg))
    for transform in _buildable_transforms(cfg):
        _noting(problems, transform.check_inputs)
    return tokenizer, problems


def _buildable_transforms(cfg: JobConfig) -> list:
    """The configured transforms, to check the files they read; none when they cannot be built (the plan that
    follows refuses that config with its own line)."""
    try:
        import_custom_module(cfg)
        return build_transforms(cfg)
    except ConfigError:
        return []


def check_output_folders(cfg: JobConfig) -> None:
    """The run can write its outputs: dump_folder, and the checkpoint folder when it saves. Nothing is created here
    (a run refused later leaves no empty folder): the folder, or the nearest one above it that exists, is probed."""
    folders = {"job.dump_folder": Path(cfg.job.dump_folder)}
    if cfg.checkpoint.enable and not cfg.checkpoint.load_only:
        folders["checkpoint.folder"] = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    for key, folder in folders.items():
        existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
        if not existing.is_dir():
            raise ConfigError(f"'{key}': cannot write to '{folder}' (Not a directory)")
        probe = existing / f".titan_lite_write_test_{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"'{key}': cannot write to '{folder}' ({exc.strerror})") from None


def export_folders(cfg: JobConfig, transforms: Transforms, step: int) -> list[Path]:
    """The folders a run that checkpoints writes at its end, step `step`: checkpoint.last_save_in_hf's step-N-hf
    and the transforms' exports (a LoRA adapter and its base, a pruned model)."""
    c = cfg.checkpoint
    if not c.enable or c.load_only:
        return []
    root = Path(cfg.job.dump_folder) / c.folder
    full = [root / f"step-{step}-hf"] if c.last_save_in_hf and transforms.exports_full_model() else []
    return full + transforms.export_folders(root, step)


def check_export_folders(cfg: JobConfig, transforms: Transforms) -> None:
    """Before training, not after it: each export folder of the last step may replace only what titan_lite wrote
    there (a user's file in it is one line naming the folder and the file; export_hf checks again at the end)."""
    for folder in export_folders(cfg, transforms, cfg.training.steps):
        check_replaceable(EXPORT_WHAT, folder, EXPORT_INSTEAD)


def check_before_launch(cfg: JobConfig, world_size: int) -> JobPlan:
    """Everything run_train.sh checks in one quick process before torchrun starts: a user error is one line."""
    validate(cfg)
    check_wandb_installed(cfg)
    choose_backend(torch.device(device_type()))
    tokenizer, problems = gather_assets(cfg)
    if problems:
        raise ConfigError(problems[0])
    plan = plan_with_tokenizer(cfg, world_size, tokenizer)
    check_data_volume(cfg, plan)
    check_source_before_launch(cfg, plan.model_args)
    check_output_folders(cfg)
    check_export_folders(cfg, plan.transforms)
    return plan
