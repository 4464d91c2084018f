"""A frozen model an objective runs beside the model it trains (distillation's teacher, preference tuning's
reference): its job config and plan on the trained model's mesh (same tokenizer and vocabulary, checked), its checks
before launch, its assembly (loaded, frozen, no optimizer state) and its weights in DRY_RUN's plan; or the trained
model itself computing its base function (the transforms switch off what they train)."""

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from titan_lite.checkpoint.resume import check_source_before_launch, plan_initial
from titan_lite.config import parse_args
from titan_lite.config.schema import ActivationCheckpoint, Checkpoint, Distill, JobConfig
from titan_lite.data.tokenizer import Tokenizer, build_tokenizer
from titan_lite.distributed import compute_dtype
from titan_lite.errors import ConfigError, quote_path
from titan_lite.job.assembly import BuiltModel, assemble_model, build_parts
from titan_lite.job.estimate import data_parallel_units, local_numel
from titan_lite.job.plan import HF_FLAVOR, JobPlan, check_initial_weights, plan_with_tokenizer, tokenizer_path
from titan_lite.job.script import model_flavor
from titan_lite.loss import cross_entropy_sum
from titan_lite.models.flavors import flavor_args
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.pipeline import PipelineRunner
from titan_lite.transforms import PlanItem

# Text whose ids two tokenizers must agree on to count as the same (words, digits, accents, CJK, spaces).
TOKENIZER_PROBE = "To be, or not to be: 1234 caf\u00e9 \u6771\u4eac  distillation\n\tThe END."
# forward(model) -> logits: runs a model on the runner's inputs of one microbatch.
Forward = Callable[[nn.Module], torch.Tensor]


@dataclass(frozen=True)
class FrozenSpec:
    """Which frozen model and the config keys that name it, for its messages."""

    path: str
    flavor: str
    config: str
    role: str  # "teacher", "reference"
    path_key: str  # "distill.teacher_path"
    flavor_key: str
    config_key: str
    trained: str  # what the objective trains: "student", "policy"
    compares: str  # why one vocabulary: "distillation compares their logits token by token"


def is_dcp_folder(path: Path) -> bool:
    return (path / ".metadata").is_file()


def frozen_config(cfg: JobConfig, spec: FrozenSpec, device_type: str) -> JobConfig:
    """The frozen model's job config: the trained model's with its own model (no transforms), weights loaded from
    spec.path, parameters stored in the compute dtype of `device_type`, resharded after every forward, nothing
    checkpointed, no objective of its own."""
    t, path = copy.deepcopy(cfg), Path(spec.path)
    check_flavor(spec)
    if is_dcp_folder(path):
        run = run_config_of(spec, path)
        t.model.flavor = spec.flavor or run.model.flavor
        t.model.hf_assets_path, t.model.tokenizer_path = run.model.hf_assets_path, run.model.tokenizer_path
        t.checkpoint = Checkpoint(initial_load_path=str(path))
    else:
        if path.is_file():
            raise ConfigError(f"'{spec.path_key}' = '{path}' is a file; the {spec.role} must be a folder: a Hugging "
                              "Face folder (config.json and safetensors) or a DCP step folder of a titan_lite run "
                              "(or 'base')")
        if not spec.flavor and not path.exists():
            raise ConfigError(f"'{spec.path_key}' = {quote_path(path)} does not exist (to plan with DRY_RUN before the "
                              f"{spec.role} is downloaded, set '{spec.flavor_key}')")
        if not spec.flavor and not (path / "config.json").is_file():
            raise ConfigError(f"'{spec.path_key}' = '{path}' has no config.json, so the {spec.role}'s shape is "
                              f"unknown: name its flavor in '{spec.flavor_key}'")
        t.model.flavor = spec.flavor or model_flavor(str(path), None)
        t.model.hf_assets_path, t.model.tokenizer_path = str(path), None
        t.checkpoint = Checkpoint(initial_load_path=str(path), initial_load_in_hf=True)
    t.model.converters, t.model.print_after_conversion = [], False
    t.activation_checkpoint = ActivationCheckpoint(mode="none")
    t.parallelism.fsdp_reshard_after_forward = "always"
    t.training.dtype = str(compute_dtype(cfg.training.mixed_precision_param, device_type)).removeprefix("torch.")
    t.validation.enable = False
    t.distill = Distill()
    return t


def check_flavor(spec: FrozenSpec) -> None:
    """The frozen model's flavor key, when set, names a known flavor (or 'hf'): its typo is named as that key."""
    if spec.flavor and spec.flavor != HF_FLAVOR:
        try:
            flavor_args(spec.flavor)
        except KeyError as exc:
            raise ConfigError(f"'{spec.flavor_key}': {exc.args[0]} (or 'hf': the shape of "
                              f"{spec.path_key}/config.json)") from None


def run_config_of(spec: FrozenSpec, step_folder: Path) -> JobConfig:
    """The config of the run that wrote a DCP step folder: spec.config, or the config.toml its run saved."""
    toml = Path(spec.config) if spec.config else step_folder.parent.parent / "config.toml"
    if not toml.is_file():
        raise ConfigError(f"'{spec.path_key}' = '{step_folder}' is a DCP checkpoint, but its run's config '{toml}' "
                          f"does not exist; set '{spec.config_key}' to the TOML of the run that wrote it")
    run = parse_args(["--job.config_file", str(toml)])
    if run.model.converters:
        raise ConfigError(f"'{spec.config_key}' = '{toml}' has model.converters = {run.model.converters}: a DCP "
                          f"{spec.role} must be a plain model; export the run to a Hugging Face folder "
                          f"(checkpoint.last_save_in_hf) and name that folder in '{spec.path_key}'")
    return run


def frozen_plan(plan: JobPlan, spec: FrozenSpec, device_type: str) -> JobPlan:
    """The frozen model's job plan on the trained model's layout (the same ParallelDims, so the same mesh), its
    vocabulary and tokenizer checked against the trained model's."""
    tcfg = frozen_config(plan.cfg, spec, device_type)
    if plan.tokenizer is not None:
        check_same_tokenizer(plan.tokenizer, tcfg, plan.cfg, spec)
    tplan = plan_with_tokenizer(tcfg, plan.parallel_dims.world_size, plan.tokenizer, count_epochs=False)
    if tplan.model_args.vocab_size != plan.model_args.vocab_size:
        raise ConfigError(f"the {spec.role} '{spec.path}' has a vocabulary of {tplan.model_args.vocab_size:,} tokens "
                          f"but the {spec.trained} ('model.flavor' = '{plan.cfg.model.flavor}') has "
                          f"{plan.model_args.vocab_size:,}: {spec.compares}, so both need the same tokenizer and "
                          "vocabulary")
    return replace(tplan, parallel_dims=plan.parallel_dims)


def check_same_tokenizer(trained: Tokenizer, tcfg: JobConfig, cfg: JobConfig, spec: FrozenSpec) -> None:
    """The frozen model's tokenizer (when its folder has one) gives the trained model's ids: one line otherwise."""
    if tokenizer_path(tcfg) == tokenizer_path(cfg):
        return
    try:
        frozen = build_tokenizer(tokenizer_path(tcfg))
    except ConfigError:
        return  # a folder of weights only: the vocabulary sizes are compared instead
    same = frozen.vocab_size == trained.vocab_size and \
        frozen.encode(TOKENIZER_PROBE, bos=True, eos=True) == trained.encode(TOKENIZER_PROBE, bos=True, eos=True)
    if not same:
        raise ConfigError(f"the {spec.role}'s tokenizer in '{tokenizer_path(tcfg)}' ({frozen.vocab_size:,} tokens) is "
                          f"not the {spec.trained}'s in '{tokenizer_path(cfg)}' ({trained.vocab_size:,} tokens): "
                          f"{spec.compares}, so a token id must mean the same token to both")


def check_frozen(plan: JobPlan, spec: FrozenSpec, device_type: str) -> None:
    """Before launch: the frozen model's files, shapes, vocabulary and tokenizer."""
    if not Path(spec.path).exists():
        raise ConfigError(f"'{spec.path_key}' = {quote_path(spec.path)} does not exist (a Hugging Face folder, a DCP "
                          "step folder of a titan_lite run, or 'base')")
    tplan = frozen_plan(plan, spec, device_type)
    check_initial_weights(tplan.cfg)
    check_source_before_launch(tplan.cfg, tplan.model_args)


def check_base_reference(plan: JobPlan, key: str, trains_in_full_fix: str | None) -> None:
    """Before launch: `key` = 'base' (the policy with its adapters switched off as the reference) needs adapters that
    keep the base apart, no adapter loaded to start from, and no module trained in full (unless `trains_in_full_fix`
    is None: the reference is then computed before training)."""
    cfg = plan.cfg
    if plan.transforms.base_function([]) is None:
        raise ConfigError(f"'{key}' = 'base' runs the policy with its adapters switched off as the reference, but no "
                          f"transform of 'model.converters' = {cfg.model.converters} keeps a base apart from what it "
                          "trains: the policy would equal its reference (nothing to learn); add adapters "
                          "(--model.converters lora) or name a reference folder")
    lora = cfg.lora if "lora" in cfg.model.converters else None
    if lora is not None and lora.train_modules and trains_in_full_fix is not None:
        raise ConfigError(f"'{key}' = 'base' with 'lora.train_modules' = {lora.train_modules}: those modules train "
                          f"in full, so switching the adapters off stops giving the base after the first step; "
                          f"{trains_in_full_fix}")
    if lora is not None and lora.adapter_path:
        raise ConfigError(f"'{key}' = 'base' with 'lora.adapter_path' = '{lora.adapter_path}': switching the "
                          "adapters off gives the model before that adapter, not the one training starts from; merge "
                          "it into its base (scripts/merge_lora.py) and train new adapters on the merged folder, or "
                          f"name the merged folder in '{key}'")


def frozen_files_problem(cfg: JobConfig, spec: FrozenSpec) -> str | None:
    """DRY_RUN's checklist line for a frozen model not downloaded yet (the plan still prints from its flavor)."""
    path = Path(spec.path)
    if is_dcp_folder(path) or (path / "config.json").is_file():
        try:
            check_initial_weights(frozen_config(cfg, spec, cfg.dry_run.device_type))
        except ConfigError as exc:
            return str(exc)
        return None
    return f"'{spec.path_key}' = '{path}': no Hugging Face folder or DCP checkpoint there (the {spec.role}'s weights)"


def assemble_frozen(plan: JobPlan, spec: FrozenSpec, device: torch.device, seed: int) -> tuple[JobPlan, BuiltModel]:
    """The frozen model built on the trained model's mesh, loaded, with no gradients, in eval mode."""
    tplan = frozen_plan(plan, spec, device.type)
    built = assemble_model(tplan, device, seed=seed, load=plan_initial(tplan.cfg))
    for part in built.parts:
        part.requires_grad_(False)
        part.eval()
    return tplan, built


@dataclass
class FrozenForward:
    """How a frozen model runs on the runner's inputs: its parts within a context (the trained model's own parts with
    the transforms' base function, or a separate model's) and, under pipeline parallelism, the pipeline that runs
    them; a separate model also keeps its plan and what it built. Called with forward(model) it returns the model's
    logits."""

    parts: list[nn.Module]
    pipeline: PipelineRunner | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    plan: JobPlan | None = None
    built: BuiltModel | None = None

    def __call__(self, forward: Forward) -> torch.Tensor:
        with self.context():
            return forward(self.parts[0])

    def describe(self, spec: FrozenSpec) -> str:
        """A separate model's words for the log: its flavor, folder and parameters."""
        p = self.plan
        return (f"{spec.role} {p.cfg.model.flavor} from '{spec.path}', {p.full_param_count():,} parameters "
                f"({self.built.param_count():,} held by this rank, {p.cfg.training.dtype}, frozen)")


def separate_forward(tplan: JobPlan, built: BuiltModel) -> FrozenForward:
    """A frozen model's logits on the runner's inputs."""
    return FrozenForward(built.parts, built.pipeline, plan=tplan, built=built)


def base_forward(plan: JobPlan, trained: BuiltModel) -> FrozenForward:
    """The trained model's own logits computing its base function (the transforms switch off what they train)."""
    return FrozenForward(trained.parts, trained.pipeline, lambda: plan.transforms.base_function(trained.parts))


def frozen_items(tplan: JobPlan, dims: ParallelDims, compute_bytes: int, role: str) -> list[PlanItem]:
    """The frozen model's weights on this rank (built on the meta device as the run builds them) and, under FSDP,
    its two largest all-gathered groups."""
    tcfg = copy.deepcopy(tplan.cfg)
    tcfg.compile.enable = False  # compile is lazy: wrapping plans nothing more
    parts, _ = build_parts(replace(tplan, cfg=tcfg, parallel_dims=dims), torch.device("cpu"), cross_entropy_sum,
                           schedule=False)
    params = [p for part in parts for p in part.parameters()]
    local = sum(local_numel(p) for p in params)
    items = [PlanItem("parameters", sum(local_numel(p) * p.element_size() for p in params),
                      f"{role} {local:,} local x {tcfg.training.dtype} (frozen)")]
    if dims.fsdp_enabled or dims.dp_replicate_enabled:
        units = sorted(data_parallel_units(tcfg, dims, parts, None), key=lambda u: u.unsharded_numel)
        items.append(PlanItem("buffers", sum(u.unsharded_numel for u in units[-2:]) * compute_bytes,
                              f"{role}: 2 all-gathered groups during its forward"))
    return items
