"""The transform contract: the hooks a model transform may implement, the context they receive, and the registry.

A transform is a small object with a name, built from the job config. The trainer (and DRY_RUN and the scripts)
calls the hooks of the configured transforms (`[model] converters`) in order and knows nothing else about them:

  convert             the meta model, before parallelism (wrap linears, add masks or gates)
  check               config checks that need the model args or the parallel layout (before launch)
  tp_plan             contributions to the tensor-parallel plan ("model" scope and per-"block" scope)
  hf_names            names the transform adds to the HF name map, or that no HF folder holds
  after_load          work on real weights and data (SVD, calibration), after the initial weights are loaded
  param_groups        optimizer parameter groups with their own hyper-parameters
  bind_optimizer      the run's optimizer, once built (to check it, or to restart the state of rewritten parameters)
  before_step         once per optimizer step, before its first forward (draw the step's random masks)
  extra_loss          a term added to the loss once per optimizer step
  after_optimizer_step  e.g. re-apply masks, re-factor adapters
  state               objects checkpointed with the run (state_dict / load_state_dict)
  saves_parameter     False for parameters left out of checkpoints (adapter-only saves)
  metrics             scalars logged with each training log line
  export_state_dict   turn a full state dict into a plain Llama's before an HF export (merge, drop, materialise)
  export              extra artifacts at the end of a run (adapter folders, reports)
  after_parallelize   one model part once TP, CP, AC, compile and FSDP are applied (on the meta device, before
                      materialisation): e.g. install an FSDP custom all-gather
  base_function       a context in which the model computes the function it was loaded with, without what the
                      transform trains (adapters off): distillation's self-teacher, no second copy of the model
  folded_for_decoding a context in which the model computes the same function more cheaply for decoding (adapters
                      folded into their base weights, restored bit for bit on exit): a rollout's sampling

The plan hooks (DRY_RUN, and scripts that plan a pass) let a transform say what it changes in the memory plan; the
estimate (`titan_lite/job/estimate.py`) calls them and nothing outside `transforms/` names a transform:

  sequence_length     the longest sequence a pass of the transform runs the model on (sizes RoPE; 0: none)
  plan_lines          lines for DRY_RUN's summary (the target architecture, the storage format, ...)
  param_bytes         bytes per element a parameter is stored in on the device (None: its dtype's); the meta
                      model DRY_RUN reads keeps the dtype it was built in, this says what the real run holds
  gathered_bytes      bytes per element FSDP's all-gather moves and holds for a parameter (None: the compute dtype)
  plan_memory         extra bytes of one rank's training step by category ("parameters", "activations",
                      "buffers", ...), each with a note: PlanItem(category, bytes, note)
  pass_plan           the memory of a pass the transform runs before training on one rank (PassPlan), or None

  check_inputs        (not a plan hook, but called with them before launch) the files the transform reads, such as
                      calibration data: raise ConfigError naming the key; DRY_RUN lists the problem and plans on

Each plan hook receives a PlanContext: the config, model args, the layout and this rank's parts as the trainer
builds them (on the meta device, compile off), plus the compute dtype's element size on the planned accelerator.
A hook of a transform that is not configured is never called; defaults change nothing.

A module a transform adds owns the initialisation of its parameters through `param_init()`, a dict from the
parameter's local name to `fn(full_tensor, generator)`; Llama.init_weights calls it with the same per-name seeding
as every other parameter, so a transform's parameters start identically on every layout.
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError, did_you_mean
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.names import HFNames
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner

# (dataset, dataset_path, nsamples, seq_len, batch_size) -> this data-parallel rank's share of the first nsamples
# windows of the dataset, as (inputs, labels) batches on the device; the same set whatever the layout.
CalibrationSource = Callable[..., Iterator[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class TransformContext:
    """What `after_load` may use: the built model and the run's components."""

    cfg: JobConfig
    model_args: LlamaArgs
    parallel_dims: ParallelDims
    device: torch.device
    tokenizer: Any
    model_parts: list[nn.Module]
    runner: ModelRunner
    calibration_batches: CalibrationSource
    # True when a checkpoint of this run is loaded after after_load: data-dependent work whose result the
    # checkpoint holds (a mask, say) can be skipped.
    resuming: bool = False
    # True when that checkpoint also brings every model parameter: the initial weights were not loaded, and work on
    # them whose result the checkpoint holds (an SVD of the base, say) must be skipped. False for adapter-only
    # checkpoints: the frozen weights were loaded from the initial weights again and such work must be redone.
    checkpoint_holds_model: bool = False
    # The Hugging Face folder the initial weights were just read from (None: they were not read from one): a
    # transform that keeps a weight in the folder's own stored form (a packed base) reads it there.
    initial_hf_folder: str | None = None


@dataclass
class PlanContext:
    """What the plan hooks may read: one rank's parts built as the trainer builds them (on the meta device)."""

    cfg: JobConfig
    model_args: LlamaArgs
    parallel_dims: ParallelDims
    model_parts: list[nn.Module]
    compute_bytes: int  # element size of the compute dtype on the planned accelerator (2 for bf16)
    device_type: str = "cuda"  # the accelerator the plan is for


@dataclass(frozen=True)
class PlanItem:
    """Bytes a transform adds to one category of a rank's training-step estimate, with what they are."""

    category: str  # "parameters", "gradients", "optimizer", "activations" or "buffers"
    nbytes: int
    note: str


@dataclass
class PassPlan:
    """The peak memory of a pass a transform runs before training, on one rank: its name (for the refusal), a title
    line, the rows of its breakdown, the peak in bytes, and the advice the refusal gives when it does not fit."""

    name: str
    title: str
    rows: list[str]
    peak: int
    advice: str


class Transform:
    """A model transform. Override only the hooks you need; each default does nothing."""

    name: str = ""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg

    def convert(self, model: nn.Module) -> None:
        """Rewrite the meta-device model before parallelism."""

    def check(self, model_args: LlamaArgs, parallel_dims: ParallelDims) -> None:
        """Raise ConfigError for settings that cannot work with this model or layout (runs before launch)."""

    def tp_plan(self, plan: dict[str, ParallelStyle], scope: str) -> dict[str, ParallelStyle]:
        """The tensor-parallel plan of scope 'model' (top-level modules) or 'block' (per transformer block)."""
        return plan

    def hf_names(self, names: HFNames) -> None:
        """Extend the run's HF name map (names.add_layer_name, names.add_not_in_hf)."""

    def after_load(self, ctx: TransformContext) -> None:
        """Work that needs real weights or data; runs after the initial weights are loaded."""

    def param_groups(self, model_parts: list[nn.Module]) -> list[dict]:
        """Extra optimizer param groups ({'params': [...], 'lr': ...}); their parameters leave the default group."""
        return []

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Receives the run's optimizer once it is built (before any checkpoint is loaded into it)."""

    def before_step(self, model_parts: list[nn.Module], step: int) -> None:
        """Runs once per optimizer step (1-based `step`), before the forward of its first microbatch."""

    def extra_loss(self, model_parts: list[nn.Module], step: int) -> torch.Tensor | None:
        """A scalar added to the loss (and backpropagated) once per optimizer step, or None."""
        return None

    def after_optimizer_step(self, model_parts: list[nn.Module], step: int) -> None:
        """Runs after every optimizer step, without gradients."""

    def state(self) -> dict[str, Any]:
        """Objects with state_dict()/load_state_dict() saved in checkpoints, by key (prefixed with the name)."""
        return {}

    def saves_parameter(self, name: str) -> bool:
        """Whether a model parameter (canonical name) goes into checkpoints."""
        return True

    def metrics(self, model_parts: list[nn.Module]) -> dict[str, float]:
        """Scalars logged with the training line (and to TensorBoard)."""
        return {}

    def export_state_dict(self, state_dict: dict[str, torch.Tensor],
                          model_args: LlamaArgs) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
        """A plain Llama's full state dict and args from this transform's (fp32, unsharded, on rank 0)."""
        return state_dict, model_args

    def export(self, model_parts: list[nn.Module], folder: Path, step: int) -> None:
        """Extra artifacts at the end of a run that checkpoints (collective: every rank calls it)."""

    def export_folders(self, folder: Path, step: int) -> list[Path]:
        """The folders `export` writes (checked at launch: each may replace only what titan_lite wrote there)."""
        return []

    def exports_full_model(self) -> bool:
        """Whether checkpoint.last_save_in_hf writes the run's full model (step-N-hf through export_state_dict);
        false where this transform's own export replaces it (a LoRA adapter without the merged model)."""
        return True

    # ------------------------------------------------------------------------------ plan hooks

    def sequence_length(self) -> int:
        """The longest sequence a pass of this transform runs the model on (0: only the training's)."""
        return 0

    def check_inputs(self) -> None:
        """Raise ConfigError when a file this transform reads (calibration data, say) is missing or unreadable."""

    def plan_lines(self, model_args: LlamaArgs) -> list[str]:
        """Lines for DRY_RUN's summary."""
        return []

    def param_bytes(self, name: str, param: torch.Tensor) -> float | None:
        """Bytes per element this parameter (canonical name) is stored in on the device, or None (its dtype's)."""
        return None

    def gathered_bytes(self, name: str, param: torch.Tensor) -> float | None:
        """Bytes per element FSDP's all-gather moves and holds for this parameter, or None (the compute dtype)."""
        return None

    def plan_memory(self, ctx: PlanContext) -> list[PlanItem]:
        """Extra bytes of one rank's training step (e.g. a dequantized weight alive during a matmul)."""
        return []

    def pass_plan(self, ctx: PlanContext) -> PassPlan | None:
        """The memory of a pass this transform runs before training, on the rank of `ctx`."""
        return None

    # ------------------------------------------------------------------------------ after parallelism

    def after_parallelize(self, model: nn.Module, parallel_dims: ParallelDims) -> None:
        """One parallelised model part (still on the meta device): e.g. set an FSDP module's custom all-gather."""

    # ------------------------------------------------------------------------------ the base function

    def base_function(self, model_parts: list[nn.Module]) -> contextlib.AbstractContextManager | None:
        """A context in which the parts compute the function they were loaded with, without what this transform
        trains (adapters switched off), or None when the transform keeps no such base apart. Asked with no parts
        before launch (whether it can), entered around a forward under no_grad (distillation's self-teacher)."""
        return None

    # ------------------------------------------------------------------------------ decoding

    def folded_for_decoding(self, model_parts: list[nn.Module]) -> contextlib.AbstractContextManager | None:
        """A context in which the parts compute the function they train (within 1e-5 in float32) with less work per
        token, every parameter restored bit for bit on exit (adapters folded into the base weights), or None. Entered
        around a rollout's decoding, under no_grad, collectively: every rank of the layout enters it together."""
        return None


_REGISTRY: dict[str, Callable[[JobConfig], Transform]] = {}
def register_transform(name: str) -> Callable:
    """Class decorator: `@register_transform("lora")` makes the class available to `[model] converters`."""
    def wrap(factory: Callable[[JobConfig], Transform]) -> Callable[[JobConfig], Transform]:
        _REGISTRY[name] = factory
        return factory
    return wrap


def registered_transforms() -> list[str]:
    return sorted(_REGISTRY)


def build_transforms(cfg: JobConfig) -> list[Transform]:
    """Instantiate the configured transforms, in order; an unknown name is one clear error."""
    transforms = []
    for name in cfg.model.converters:
        if name not in _REGISTRY:
            known = ", ".join(registered_transforms()) or "none"
            raise ConfigError(f"'model.converters' has unknown transform '{name}'"
                              f"{did_you_mean(name, registered_transforms())}; available: {known}")
        transforms.append(_REGISTRY[name](cfg))
    return transforms


# The newer families' parts each transform has been checked on (against transformers): any other transform is
# refused there in one line. Qwen3.5-MoE: LoRA on its shared expert (never its gate) and routed experts, pruning of
# its dense projections (REAP and depth run from scripts/prune.py).
CHECKED_ON_NEWER_FAMILIES = {
    "qwen3_5": ("Qwen3.5 (its linear_attention layers)", ("lora", "prune", "quantize.linear.float8")),
    "qwen3_5_moe": ("Qwen3.5-MoE (its linear_attention layers and gated shared expert)", ("lora", "prune")),
    "gpt_oss": ("gpt-oss (its sinks, biases and clamped experts)", ("lora", "prune")),
    "gemma3_text": ("Gemma 3 (its sandwich norms and scaled embedding)", ("lora", "prune", "quantize.linear.float8")),
    "deepseek_v3": ("DeepSeek-V3 (its latent attention and shared experts)", ("lora", "prune",
                                                                             "quantize.linear.float8")),
}


def _newer_family(model_args: LlamaArgs) -> tuple[str | None, tuple[str, ...]]:
    """(label, checked transforms) of a newer family's model, or (None, ()) for the established ones."""
    return CHECKED_ON_NEWER_FAMILIES.get(model_args.family, (None, ()))


class Transforms:
    """The configured transforms, called in order; what the trainer, DRY_RUN and the scripts talk to."""

    def __init__(self, transforms: list[Transform]):
        self.items = transforms

    def __iter__(self) -> Iterator[Transform]:
        return iter(self.items)

    def convert(self, model: nn.Module) -> None:
        for t in self.items:
            t.convert(model)

    def check(self, model_args: LlamaArgs, parallel_dims: ParallelDims) -> None:
        label, checked = _newer_family(model_args)
        unchecked = [t.name for t in self.items if t.name not in checked]
        if label and unchecked:
            raise ConfigError(f"'model.converters' has {unchecked}, which is not supported yet for {label}: only "
                              f"{list(checked)} have been checked there")
        for t in self.items:
            t.check(model_args, parallel_dims)

    def tp_plan_edits(self) -> list[Callable]:
        return [t.tp_plan for t in self.items]

    def hf_names(self) -> HFNames:
        names = HFNames()
        for t in self.items:
            t.hf_names(names)
        return names

    def after_load(self, ctx: TransformContext) -> None:
        for t in self.items:
            t.after_load(ctx)

    def param_groups(self, model_parts: list[nn.Module]) -> list[dict]:
        return [g for t in self.items for g in t.param_groups(model_parts)]

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for t in self.items:
            t.bind_optimizer(optimizer)

    def before_step(self, model_parts: list[nn.Module], step: int) -> None:
        for t in self.items:
            t.before_step(model_parts, step)

    def extra_loss(self, model_parts: list[nn.Module], step: int) -> torch.Tensor | None:
        terms = [term for t in self.items if (term := t.extra_loss(model_parts, step)) is not None]
        return torch.stack(terms).sum() if terms else None

    @torch.no_grad()
    def after_optimizer_step(self, model_parts: list[nn.Module], step: int) -> None:
        for t in self.items:
            t.after_optimizer_step(model_parts, step)

    def state(self) -> dict[str, Any]:
        return {f"transform.{t.name}.{key}": obj for t in self.items for key, obj in t.state().items()}

    def saves_parameter(self, name: str) -> bool:
        return all(t.saves_parameter(name) for t in self.items)

    def metrics(self, model_parts: list[nn.Module]) -> dict[str, float]:
        return {k: v for t in self.items for k, v in t.metrics(model_parts).items()}

    def export_state_dict(self, state_dict: dict[str, torch.Tensor],
                          model_args: LlamaArgs) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
        for t in reversed(self.items):  # undo the last transform first
            state_dict, model_args = t.export_state_dict(state_dict, model_args)
        return state_dict, model_args

    def export(self, model_parts: list[nn.Module], folder: Path, step: int) -> None:
        for t in self.items:
            t.export(model_parts, folder, step)

    def export_folders(self, folder: Path, step: int) -> list[Path]:
        return [out for t in self.items for out in t.export_folders(folder, step)]

    def exports_full_model(self) -> bool:
        return all(t.exports_full_model() for t in self.items)

    # ------------------------------------------------------------------------------ plan hooks

    def sequence_length(self) -> int:
        return max((t.sequence_length() for t in self.items), default=0)

    def plan_lines(self, model_args: LlamaArgs) -> list[str]:
        return [line for t in self.items for line in t.plan_lines(model_args)]

    def param_bytes(self, name: str, param: torch.Tensor) -> float:
        """Bytes per element of a parameter as stored: the first transform that says, else its dtype's."""
        return _first((t.param_bytes(name, param) for t in self.items), param.element_size())

    def gathered_bytes(self, name: str, param: torch.Tensor, compute_bytes: int) -> float:
        return _first((t.gathered_bytes(name, param) for t in self.items), compute_bytes)

    def plan_memory(self, ctx: PlanContext) -> list[PlanItem]:
        return [item for t in self.items for item in t.plan_memory(ctx)]

    def pass_plans(self, ctx: PlanContext) -> list[PassPlan]:
        return [plan for t in self.items if (plan := t.pass_plan(ctx)) is not None]

    def after_parallelize(self, model: nn.Module, parallel_dims: ParallelDims) -> None:
        for t in self.items:
            t.after_parallelize(model, parallel_dims)

    def base_function(self, model_parts: list[nn.Module]) -> contextlib.AbstractContextManager | None:
        """Every transform's base-function context, entered together, or None when none keeps a base apart."""
        contexts = [c for t in self.items if (c := t.base_function(model_parts)) is not None]
        return _entered_together(contexts) if contexts else None

    def folded_for_decoding(self, model_parts: list[nn.Module]) -> contextlib.AbstractContextManager | None:
        """Every transform's decoding context, entered together, or None when none has one."""
        contexts = [c for t in self.items if (c := t.folded_for_decoding(model_parts)) is not None]
        return _entered_together(contexts) if contexts else None


@contextlib.contextmanager
def _entered_together(contexts: list[contextlib.AbstractContextManager]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _first(values: Iterator[float | None], default: float) -> float:
    return next((v for v in values if v is not None), default)
