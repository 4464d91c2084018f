"""The load plan (the design's step 8, decided once before assembly): which checkpoint a run continues from and
why, the initial weights it starts from otherwise, whether a checkpoint restores the whole model (adapter-only ones do
not), and the checks of all that before launch. Assembly and the checkpoint manager consume the plan."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from titan_lite.checkpoint import dcp as ckpt
from titan_lite.checkpoint.hf import check_hf_folder, expected_shapes
from titan_lite.config.schema import Checkpoint, JobConfig
from titan_lite.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InitialWeights:
    """The weights a run starts from when it does not resume: an HF folder, or a DCP checkpoint's model weights (and,
    with checkpoint.initial_load_model_only = false, its whole training state, loaded once the optimizer exists)."""

    kind: str  # "hf" or "dcp"
    path: Path
    model_only: bool = True


@dataclass(frozen=True)
class LoadPlan:
    """What a run loads, decided once before assembly. `checkpoint`: the DCP folder loaded on top of the assembled
    model (this run's own to resume it, or one an inference script is given), its whole training state or
    (`whole_state` False) its model only. `initial`: the weights assembly loads first, unless the checkpoint restores
    every parameter (an adapter-only checkpoint does not: then the initial weights bring the rest). `note`: why the
    checkpoint is not the newest, when it is not."""

    checkpoint: Path | None = None
    initial: InitialWeights | None = None
    whole_state: bool = True
    note: str | None = None

    @property
    def resuming(self) -> bool:
        return self.checkpoint is not None

    def restores_model(self, parts: list[nn.Module], saves_parameter: Callable[[str], bool] | None) -> bool:
        """Whether loading the checkpoint restores every parameter of the assembled parts (see holds_model)."""
        return self.checkpoint is not None and holds_model(self.checkpoint, parts, saves_parameter)

    def state_to_load(self) -> tuple[Path, bool] | None:
        """(folder, model only) the checkpoint manager loads after assembly: the checkpoint, else an initial DCP
        checkpoint's whole training state; None when assembly loaded all there is."""
        if self.checkpoint is not None:
            return self.checkpoint, not self.whole_state
        if self.initial is not None and self.initial.kind == "dcp" and not self.initial.model_only:
            return self.initial.path, False
        return None


def checkpoint_root(cfg: JobConfig) -> Path:
    """The run's checkpoint folder: job.dump_folder / checkpoint.folder."""
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def plan_resume(cfg: JobConfig, announce: bool = False) -> LoadPlan:
    """A training run's load plan: its own checkpoint to continue from (choose_resume), else its initial weights.
    `announce` (rank 0): warn once about saves that never finished and about a resume that is not the newest."""
    root = checkpoint_root(cfg)
    choice = choose_resume(cfg.checkpoint, root)
    if announce:
        warn_incomplete_saves(cfg.checkpoint, root)
        if choice.note:
            logger.warning(choice.note)
    return LoadPlan(choice.folder, initial_weights(cfg), note=choice.note)


def plan_initial(cfg: JobConfig, checkpoint: Path | None = None) -> LoadPlan:
    """The config's initial weights, and a given checkpoint's saved parameters on top (its model only): what the
    inference entry points and a frozen model load."""
    return LoadPlan(checkpoint, initial_weights(cfg), whole_state=False)


def plan_weights(kind: str, path: str | Path) -> LoadPlan:
    """A script's load plan: start from these weights ("hf": an HF folder; "dcp": a DCP checkpoint's model)."""
    return LoadPlan(initial=InitialWeights(kind, Path(path)))


def initial_weights(cfg: JobConfig) -> InitialWeights | None:
    """initial_source as the plan holds it, with checkpoint.initial_load_model_only."""
    source = initial_source(cfg)
    if source is None:
        return None
    kind, path = source
    return InitialWeights(kind, path, model_only=kind == "hf" or cfg.checkpoint.initial_load_model_only)


@dataclass
class ResumeChoice:
    """The checkpoint a run continues from (None: it starts fresh) and, when it is not the newest, why."""

    folder: Path | None
    note: str | None = None


def holds_training_state(folder: Path) -> bool:
    """A full checkpoint (step, optimizer, schedule, data position), not a model-only final save or seed."""
    return ckpt.has_component(ckpt.read_metadata(folder), "train_state")


def choose_resume(c: Checkpoint, root: Path) -> ResumeChoice:
    """This run's checkpoint to continue from: load_step's folder (which must exist and be complete), else the newest
    complete one; None when there is none or checkpointing is off (incomplete saves are never chosen).

    A model-only checkpoint after step 0 (a final save with last_save_model_only) cannot continue a run: the newest
    checkpoint with the training state is chosen instead, with a note; with none, the run is refused, so that it
    never starts again from step 0 over the checkpoints of the run it would not continue. A model-only step 0 is a
    seed checkpoint: the run starts from its weights."""
    if not c.enable or c.create_seed_checkpoint:
        return ResumeChoice(None)
    if c.load_step != -1:
        folder = _load_step_folder(c, root)
        _refuse_model_only(folder, root, "'checkpoint.load_step' = " + str(c.load_step))
        return ResumeChoice(folder)
    complete = ckpt.complete_steps(root)
    if not complete:
        return ResumeChoice(None)
    newest = complete[max(complete)]
    if max(complete) == 0 or holds_training_state(newest):
        return ResumeChoice(newest)
    for step in sorted(complete, reverse=True):
        if holds_training_state(complete[step]):
            return ResumeChoice(complete[step], note=(
                f"'{newest}' holds model weights only (a final save with 'checkpoint.last_save_model_only' = true), "
                f"so the run continues from '{complete[step]}', its newest checkpoint with the training state: "
                f"steps {step + 1}-{max(complete)} run again"))
    _refuse_model_only(newest, root, "the newest checkpoint")
    return ResumeChoice(newest)


def _load_step_folder(c: Checkpoint, root: Path) -> Path:
    folder = ckpt.step_folder(root, c.load_step)
    if not folder.is_dir() and ckpt.tmp_folder(root, c.load_step).is_dir():
        raise ConfigError(f"'checkpoint.load_step' = {c.load_step}: the save of '{folder}' never finished "
                          f"(only '{ckpt.tmp_folder(root, c.load_step)}' exists)")
    if not folder.is_dir():
        raise ConfigError(f"'checkpoint.load_step' = {c.load_step}: checkpoint folder '{folder}' does not exist")
    return folder


def _refuse_model_only(folder: Path, root: Path, which: str) -> None:
    if folder.name == "step-0" or holds_training_state(folder):
        return
    raise ConfigError(f"{which} '{folder}' holds model weights only ('checkpoint.last_save_model_only' = true) and "
                      f"cannot continue a run; to train from these weights without touching the checkpoints in "
                      f"'{root}', set --checkpoint.initial_load_path {folder} and another --job.dump_folder")


def resume_folder(c: Checkpoint, root: Path) -> Path | None:
    """The folder of choose_resume (see there)."""
    return choose_resume(c, root).folder


def check_seed_target(c: Checkpoint, root: Path) -> None:
    """A seed checkpoint goes into an empty checkpoint folder: never next to (or over) another run's checkpoints."""
    if c.enable and c.create_seed_checkpoint:
        existing = sorted(ckpt.complete_steps(root))
        if existing:
            raise ConfigError(f"'checkpoint.create_seed_checkpoint' = true but '{root}' already holds checkpoints "
                              f"(steps {', '.join(map(str, existing))}); use an empty 'checkpoint.folder' or "
                              f"'job.dump_folder'")


def warn_incomplete_saves(c: Checkpoint, root: Path) -> None:
    """One warning per save that never finished (a killed run's leftovers), which resuming skips."""
    if c.enable:
        for folder in ckpt.incomplete_folders(root):
            logger.warning(f"skipping incomplete checkpoint '{folder}': its save never finished")


def initial_source(cfg: JobConfig) -> tuple[str, Path] | None:
    """The weights a run starts from when it does not resume: ("hf", an HF folder), ("dcp", a DCP folder) or None."""
    c = cfg.checkpoint
    if c.create_seed_checkpoint:
        return None
    if c.initial_load_in_hf:
        folder = c.initial_load_path or cfg.model.hf_assets_path
        if not folder:
            raise ConfigError("'checkpoint.initial_load_in_hf' = true needs 'checkpoint.initial_load_path' or "
                              "'model.hf_assets_path' to name a Hugging Face folder")
        return "hf", Path(folder)
    if c.initial_load_path:
        return "dcp", Path(c.initial_load_path)
    return None


def holds_model(folder: Path, model_parts: list[nn.Module],
                saves_parameter: Callable[[str], bool] | None = None) -> bool:
    """Whether loading the checkpoint restores every model parameter of the parts: each is one the run saves
    (`saves_parameter`) and is in the checkpoint. Adapter-only checkpoints do not."""
    saved = ckpt.read_metadata(folder).state_dict_metadata
    saves = saves_parameter or (lambda name: True)
    return all(saves(name) and f"model.{name}" in saved for name in ckpt.model_state_dict(model_parts))


def check_source_before_launch(cfg: JobConfig, model_args) -> None:
    """Read only headers and metadata of what the run will load, so a missing, corrupt or mismatched checkpoint is
    one line before any process starts. Transforms may rename or reshape parameters: then the run itself checks."""
    check_seed_target(cfg.checkpoint, checkpoint_root(cfg))
    loading = plan_resume(cfg)
    if cfg.model.converters or (loading.checkpoint is None and loading.initial is None):
        return
    if loading.checkpoint is None and loading.initial.kind == "hf":
        check_hf_folder(str(loading.initial.path), model_args)
        return
    path = loading.checkpoint or loading.initial.path
    metadata = ckpt.read_metadata(path)
    ckpt.check_storage_files(path, metadata)
    if not ckpt.has_component(metadata, "model"):
        raise ConfigError(f"checkpoint '{path}' holds no model weights")
    with torch.device("meta"):
        wanted = {name: torch.empty(shape) for name, shape in expected_shapes(model_args).items()}
    ckpt.check_tensors_match(path, metadata, wanted, "model")
