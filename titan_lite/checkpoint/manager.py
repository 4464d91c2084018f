"""CheckpointManager: when and what to save and load (DCP step folders, atomic renames; loading what a load plan,
checkpoint/resume.py, names)."""

import contextlib
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from titan_lite.checkpoint import dcp as ckpt
from titan_lite.checkpoint.hf import load_hf_weights
from titan_lite.checkpoint.resume import LoadPlan, check_seed_target, resume_folder, warn_incomplete_saves
from titan_lite.config.schema import Checkpoint
from titan_lite.errors import ConfigError, TrainingFault
from titan_lite.faults import any_rank, nonfinite_parameter

logger = logging.getLogger(__name__)

# Test hook: after the DCP write of this step and before its folder is renamed, sleep STALL_SECONDS so a
# test can SIGKILL the run in the middle of a save.
STALL_STEP_ENV = "TITAN_LITE_TEST_STALL_SAVE_STEP"
STALL_SECONDS_ENV = "TITAN_LITE_TEST_STALL_SAVE_SECONDS"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RankLocal:
    """A stateful object saved once per rank (or per data-parallel rank) under `{name}_{suffix}`. A checkpoint of
    another layout holds other suffixes: then the object keeps its fresh state and `note(saved suffixes)` says so."""

    def __init__(self, obj: Stateful, suffix: str, note: Callable[[list[str]], str]):
        self.obj, self.suffix, self.note = obj, suffix, note

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)


class RNGState:
    """Python, torch CPU and device RNG states of this process."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if self.device.type != "cpu":
            state["device"] = torch.get_device_module(self.device.type).get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "device" in state and self.device.type != "cpu":
            torch.get_device_module(self.device.type).set_rng_state(state["device"], self.device)


class CheckpointManager:
    """Saves model parts, optimizer and a dict of stateful objects every `interval` steps to {folder}/step-N, and
    loads them back (resharding to the current layout).

    It knows nothing about the trainer or the transforms: they hand it components. `states` maps a name to an
    object with state_dict()/load_state_dict() (wrapped in RankLocal when each rank has its own); `saves_parameter`
    leaves model parameters out of checkpoints (adapter-only saves: the rest comes from the initial weights).
    """

    def __init__(self, cfg: Checkpoint, folder: Path, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer,
                 states: dict[str, Stateful], saves_parameter: Callable[[str], bool] | None = None):
        self.c = cfg
        self.root = Path(folder)
        self.model_parts = model_parts
        self.optimizer = optimizer
        self.states = states
        self.saves_parameter = saves_parameter or (lambda name: True)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.enabled = cfg.enable
        self.pg = self._checkpoint_group()
        self._pending: tuple[Future, int] | None = None
        self.resumed_step: int | None = None  # keep_latest_k never removes the checkpoint this run resumed from
        self.last_saved_step: int | None = None
        if self.enabled and cfg.async_mode == "async_with_pinned_mem":
            logger.info("checkpoint.async_mode 'async_with_pinned_mem' saves like 'async' (staging in pinned memory "
                        "is not implemented)")

    def _checkpoint_group(self):
        """Async saves run collectives from a background thread, so they get their own group, and DCP's async save
        needs a CPU backend: gloo, whatever the training backend is."""
        if self.enabled and self.c.async_mode != "disabled":
            return dist.new_group(backend="gloo")
        return None

    @property
    def is_async(self) -> bool:
        return self.c.async_mode != "disabled"

    # -------------------------------------------------------------------------------- state

    @staticmethod
    def key_of(name: str, obj: Stateful) -> str:
        return f"{name}_{obj.suffix}" if isinstance(obj, RankLocal) else name

    def _model_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in ckpt.model_state_dict(self.model_parts).items() if self.saves_parameter(k)}

    def _full_state(self) -> dict[str, Any]:
        state = {"model": self._model_state(),
                 "optimizer": ckpt.optimizer_state_dict(self.model_parts, self.optimizer)}
        for name, obj in self.states.items():
            state[self.key_of(name, obj)] = ckpt.pack(obj.state_dict())
        return state

    def _model_only_state(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        model = self._model_state()
        if dtype is not None:  # weights only: masks and other non-float buffers keep their dtype
            model = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}
        return {"model": model}

    # -------------------------------------------------------------------------------- save

    def should_save(self, step: int, last: bool) -> bool:
        if not self.enabled or self.c.load_only:
            return False
        return last or step % self.c.interval == 0 or (step == 1 and self.c.enable_first_step_checkpoint)

    def save(self, step: int, last: bool = False, force: bool = False) -> bool:
        """Save after `step` when it is due (or `force`d: a graceful stop); the final save may hold the model only
        (last_save_model_only). True when this step is saved (now or already). Parameters holding NaN or infinity
        are never saved: that is a TrainingFault naming the parameter."""
        if not self.enabled or self.c.load_only:
            return False
        if step == self.last_saved_step:
            return True
        if not (force or self.should_save(step, last)):
            return False
        self._check_finite(step)
        if last and self.c.last_save_model_only and not force:
            self._save(step, self._model_only_state(getattr(torch, self.c.export_dtype)), asynchronous=False)
        else:
            self._save(step, self._full_state(), asynchronous=self.is_async)
        return True

    def _check_finite(self, step: int) -> None:
        # Only trainable parameters: frozen ones cannot turn non-finite in training (and may be packed formats)
        params = ((name, p) for part in self.model_parts for name, p in part.named_parameters() if p.requires_grad)
        bad = nonfinite_parameter(params)
        if any_rank(bad is not None):
            where = f"parameter '{bad}'" if bad else "a parameter on another rank"
            raise TrainingFault(f"step {step}: {where} holds NaN or infinity, so checkpoint step-{step} is not "
                                f"saved; {self.newest_note()}")

    def newest_note(self) -> str:
        """Where the run can continue from, for messages about a step that was not saved."""
        complete = ckpt.complete_steps(self.root)
        if not complete:
            return "no checkpoint of this run exists yet"
        return f"the newest complete checkpoint is '{complete[max(complete)]}'"

    def save_seed(self) -> None:
        """create_seed_checkpoint: the freshly initialised model as step-0, then the caller stops."""
        check_seed_target(self.c, self.root)
        self._save(0, self._model_only_state(), asynchronous=False)
        self.finish()
        logger.info(f"seed checkpoint written to {ckpt.step_folder(self.root, 0)}")

    def _save(self, step: int, state: dict[str, Any], asynchronous: bool) -> None:
        self.wait_for_pending_save()
        tmp = ckpt.tmp_folder(self.root, step)
        self.last_saved_step = step
        with self._failing_save(step):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed run
                tmp.mkdir(parents=True)
            self._barrier()
            begin = time.monotonic()
            logger.info(f"saving checkpoint step {step} to {tmp}")
            if asynchronous:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg)
                self._pending = (future, step)
                logger.info(f"checkpoint step {step}: staged in {time.monotonic() - begin:.2f}s, writing in the "
                            "background")
                return
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.pg)
            self._commit(step)
        logger.info(f"checkpoint step {step} saved to {ckpt.step_folder(self.root, step)} "
                    f"in {time.monotonic() - begin:.2f}s")

    def wait_for_pending_save(self) -> None:
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        with self._failing_save(step):
            future.result()
            self._commit(step)
        logger.info(f"checkpoint step {step} saved to {ckpt.step_folder(self.root, step)} (async)")

    @contextlib.contextmanager
    def _failing_save(self, step: int) -> Iterator[None]:
        """A save that cannot be written (disk full, no permission) becomes one line; its unfinished folder is
        removed, and the earlier checkpoints stay as they were."""
        try:
            yield
        except (CheckpointException, OSError) as exc:
            tmp = ckpt.tmp_folder(self.root, step)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise TrainingFault(f"checkpoint step {step} could not be written to '{tmp}' ({free_space(self.root)}): "
                                f"{write_failure(exc)}; {self.newest_note()}") from None

    def _commit(self, step: int) -> None:
        """Every rank has written step-N.tmp: rank 0 renames it to step-N, which makes it loadable."""
        self._maybe_stall_for_test(step)
        self._barrier()
        if self.rank == 0:
            final = ckpt.step_folder(self.root, step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(ckpt.tmp_folder(self.root, step), final)
            self._purge_old_checkpoints(step)
            self._remove_older_unfinished_saves(step)
        self._barrier()

    def _maybe_stall_for_test(self, step: int) -> None:
        if os.environ.get(STALL_STEP_ENV) == str(step):
            logger.info(f"test hook: stalling the save of step {step} before its rename (pid {os.getpid()})")
            time.sleep(float(os.environ.get(STALL_SECONDS_ENV, "60")))

    def _purge_old_checkpoints(self, saved_step: int) -> None:
        """Keep the newest k, the one just saved and the one this run resumed from (whatever their numbers)."""
        k = self.c.keep_latest_k
        if k <= 0:
            return
        steps = sorted(ckpt.complete_steps(self.root))
        keep = {*steps[-k:], saved_step, self.resumed_step}
        for step in steps:
            if step not in keep:
                shutil.rmtree(ckpt.step_folder(self.root, step), ignore_errors=True)
                logger.info(f"removed checkpoint step {step} (keep_latest_k = {k})")

    def _remove_older_unfinished_saves(self, step: int) -> None:
        """Leftovers of killed saves older than a complete checkpoint are never loaded: remove them."""
        for folder in ckpt.incomplete_folders(self.root):
            m = ckpt.TMP_FOLDER.match(folder.name)
            if m and int(m.group(1)) < step:
                shutil.rmtree(folder, ignore_errors=True)
                logger.info(f"removed unfinished save {folder}")

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.pg)

    def finish(self) -> None:
        """Wait for a background save so that no checkpoint is left half-written at exit."""
        self.wait_for_pending_save()

    # -------------------------------------------------------------------------------- load

    def load_planned(self, plan: LoadPlan) -> None:
        """What the load plan leaves to the manager once the model is assembled (LoadPlan.state_to_load)."""
        target = plan.state_to_load()
        if target is not None:
            self.load_folder(*target)

    def load(self) -> None:
        """On its own (no assembly loaded the initial weights): resume from this run's checkpoint, else load the
        initial DCP checkpoint (initial_load_path), if any."""
        if self.rank == 0:
            warn_incomplete_saves(self.c, self.root)
        folder = resume_folder(self.c, self.root)
        if folder is not None:
            self.load_folder(folder, model_only=False)
        elif self.c.initial_load_path and not self.c.initial_load_in_hf and not self.c.create_seed_checkpoint:
            self.load_folder(Path(self.c.initial_load_path), model_only=self.c.initial_load_model_only)

    def load_folder(self, folder: Path, model_only: bool) -> None:
        """Load what the folder holds (minus exclude_from_loading) into the components."""
        metadata = ckpt.read_metadata(folder)
        ckpt.check_storage_files(folder, metadata)
        wanted = self._components_to_load(metadata, model_only)
        state = self._placeholders(wanted, metadata, folder)
        if not state:
            logger.info(f"nothing loaded from checkpoint {folder}: every part of it is excluded")
            return
        try:
            dcp.load(state, checkpoint_id=str(folder), process_group=self.pg)
        except (CheckpointException, OSError) as exc:
            raise ConfigError(f"checkpoint '{folder}' cannot be read: {root_cause(exc)}") from None
        self._apply(state)
        if folder.parent == self.root and ckpt.STEP_FOLDER.match(folder.name):
            self.resumed_step = int(ckpt.STEP_FOLDER.match(folder.name).group(1))
        logger.info(f"loaded checkpoint {folder} ({', '.join(sorted(state))})")

    def _components_to_load(self, metadata, model_only: bool) -> set[str]:
        excluded = set(self.c.exclude_from_loading)
        if model_only:
            return {"model"} - excluded
        present = {name for name in ("model", "optimizer", *self.states) if self._present(metadata, name)}
        if present == {"model"} and self.rank == 0:
            logger.warning("this checkpoint holds model weights only (a seed checkpoint, or a model-only save): "
                           "optimizer, LR schedule, data position and step start fresh")
        return present - excluded

    def _present(self, metadata, name: str) -> bool:
        obj = self.states.get(name)
        if isinstance(obj, RankLocal):
            return bool(ckpt.components_matching(metadata, f"{name}_"))
        return ckpt.has_component(metadata, name)

    def _placeholders(self, wanted: set[str], metadata, folder: Path) -> dict[str, Any]:
        """The state to load into: current tensors give DCP the target shapes and shardings."""
        state: dict[str, Any] = {}
        if "model" in wanted:
            state["model"] = self._model_state()
            ckpt.check_tensors_match(folder, metadata, state["model"], "model")
        if "optimizer" in wanted:
            state["optimizer"] = ckpt.optimizer_state_dict(self.model_parts, self.optimizer)
            ckpt.check_tensors_match(folder, metadata, state["optimizer"], "optimizer")
        for name, obj in self.states.items():
            if name not in wanted:
                continue
            key = self.key_of(name, obj)
            if ckpt.has_component(metadata, key):
                state[key] = b""
            elif self.rank == 0:
                saved = [k.removeprefix(f"{name}_") for k in ckpt.components_matching(metadata, f"{name}_")]
                logger.warning(f"checkpoint {folder} {obj.note(saved)}")
        return state

    def _apply(self, state: dict[str, Any]) -> None:
        if "model" in state:
            ckpt.load_model_state_dict(self.model_parts, state["model"])
        if "optimizer" in state:
            ckpt.load_optimizer_state_dict(self.model_parts, self.optimizer, state["optimizer"])
        for name, obj in self.states.items():
            key = self.key_of(name, obj)
            if key in state:
                obj.load_state_dict(ckpt.unpack(state[key]))


def root_cause(exc: BaseException) -> str:
    """The first underlying error of a failed DCP save or load (DCP wraps each rank's), in one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = failures[min(failures)][0]
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def write_failure(exc: BaseException) -> str:
    """root_cause of a failed save; torch.save into a file whose write failed (a full disk, a file-size limit)
    reports only a position mismatch of its zip writer, so that is said in words."""
    cause = root_cause(exc)
    if "unexpected pos" in cause:
        return f"a write stopped short, as on a full disk ({cause})"
    return cause


def free_space(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**30:.1f} GiB free there"
    except OSError:
        return "free space unknown"


def load_initial_weights(load: LoadPlan, parts: list[nn.Module], cfg: Checkpoint, model_args,
                         hf_names: Callable[[], Any], saves_parameter: Callable[[str], bool] | None = None) -> bool:
    """Assembly's share of the load plan, into the materialised parts: the initial weights (an HF folder, read with
    the transforms' `hf_names`, or a DCP checkpoint's model), unless the plan's checkpoint restores every parameter.
    True when it does (the checkpoint, loaded later, brings the whole model)."""
    restores_model = load.restores_model(parts, saves_parameter)
    if load.initial is None or restores_model:
        return restores_model
    if load.initial.kind == "hf":
        load_hf_weights(parts, str(load.initial.path), model_args, hf_names())
        logger.info(f"loaded Hugging Face weights from {load.initial.path}")
    else:
        weights_only_loader(cfg, load.initial.path)(parts)
    return restores_model


def weights_only_loader(cfg: Checkpoint, folder: Path) -> Callable[[list[nn.Module]], None]:
    """Loads the model weights of a DCP checkpoint (initial_load_path) into model parts."""
    def load(model_parts: list[nn.Module]) -> None:
        manager = CheckpointManager(replace(cfg, enable=False), folder, model_parts, None, {})
        manager.load_folder(folder, model_only=True)
    return load
