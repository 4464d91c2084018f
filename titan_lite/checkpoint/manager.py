"""CheckpointManager: when and what to save and load (DCP step folders, atomic renames, HF import/export)."""

import logging
import os
import random
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titan_lite.checkpoint import dcp as ckpt
from titan_lite.errors import ConfigError
from titan_lite.config.schema import JobConfig

if TYPE_CHECKING:
    from titan_lite.train import Trainer

logger = logging.getLogger(__name__)

# Test hook: after the DCP write of this step and before its folder is renamed, sleep STALL_SECONDS so a
# test can SIGKILL the run in the middle of a save.
STALL_STEP_ENV = "TITAN_LITE_TEST_STALL_SAVE_STEP"
STALL_SECONDS_ENV = "TITAN_LITE_TEST_STALL_SAVE_SECONDS"

LOADABLE = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")


class CheckpointManager:
    """Saves the trainer's state every `interval` steps to {dump_folder}/{folder}/step-N and resumes from it."""

    def __init__(self, cfg: JobConfig, trainer: "Trainer"):
        self.cfg = cfg
        self.c = cfg.checkpoint
        self.trainer = trainer
        self.root = Path(cfg.job.dump_folder) / self.c.folder
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.enabled = self.c.enable
        self._check_seed_checkpoint_request()
        self.pg = self._checkpoint_group()
        self._pending: tuple[Future, int] | None = None
        if self.enabled and self.c.async_mode == "async_with_pinned_mem":
            logger.info("checkpoint.async_mode 'async_with_pinned_mem' saves like 'async' (staging in pinned memory "
                        "is not implemented)")

    # -------------------------------------------------------------------------------- setup

    def _check_seed_checkpoint_request(self) -> None:
        if not self.c.create_seed_checkpoint:
            return
        pd = self.trainer.parallel_dims
        degrees = (pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp, pd.pp)
        if self.world_size != 1 or any(d != 1 for d in degrees):
            raise ConfigError(f"'checkpoint.create_seed_checkpoint' needs one process and every parallel degree 1; "
                              f"got {pd.describe()}")

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

    def _dp_rank_and_degree(self) -> tuple[int, int]:
        mesh = self.trainer.parallel_dims.submesh("batch")
        return mesh.get_local_rank(), mesh.size()

    def _dataloader_key(self) -> str:
        dp_rank, dp_degree = self._dp_rank_and_degree()
        return f"dataloader_dp{dp_rank}_of_{dp_degree}"

    def _rng_key(self) -> str:
        return f"rng_rank{self.rank}_of_{self.world_size}"

    def _rng_state(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        device = self.trainer.device
        if device.type != "cpu":
            state["device"] = torch.get_device_module(device.type).get_rng_state(device)
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        device = self.trainer.device
        if "device" in state and device.type != "cpu":
            torch.get_device_module(device.type).set_rng_state(state["device"], device)

    def _full_state(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "model": ckpt.model_state_dict(t.model_parts),
            "optimizer": ckpt.optimizer_state_dict(t.model_parts, t.optimizer),
            "lr_scheduler": ckpt.pack(t.lr_schedule.state_dict()),
            "train_state": ckpt.pack(t.train_state.state_dict()),
            self._dataloader_key(): ckpt.pack(t.dataloader.state_dict()),
            self._rng_key(): ckpt.pack(self._rng_state()),
        }

    def _model_only_state(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        model = ckpt.model_state_dict(self.trainer.model_parts)
        if dtype is not None:
            model = {k: v.to(dtype) for k, v in model.items()}
        return {"model": model}

    # -------------------------------------------------------------------------------- save

    def should_save(self, step: int, last: bool) -> bool:
        if not self.enabled or self.c.load_only:
            return False
        return last or step % self.c.interval == 0 or (step == 1 and self.c.enable_first_step_checkpoint)

    def save(self, step: int, last: bool = False) -> None:
        """Save after `step` when it is due; the final save may hold the model only (last_save_model_only)."""
        if self.should_save(step, last):
            if last and self.c.last_save_model_only:
                dtype = getattr(torch, self.c.export_dtype)
                self._save(step, self._model_only_state(dtype), asynchronous=False)
            else:
                self._save(step, self._full_state(), asynchronous=self.is_async)
        if last and self.c.last_save_in_hf and not self.c.load_only:
            self.export_hf(step)

    def save_seed(self) -> None:
        """create_seed_checkpoint: the freshly initialised model as step-0, then the caller stops."""
        self._save(0, self._model_only_state(), asynchronous=False)
        self.finish()
        logger.info(f"seed checkpoint written to {ckpt.step_folder(self.root, 0)}")

    def _save(self, step: int, state: dict[str, Any], asynchronous: bool) -> None:
        self.wait_for_pending_save()
        tmp = ckpt.tmp_folder(self.root, step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed run
            tmp.mkdir(parents=True)
        self._barrier()
        begin = time.monotonic()
        if asynchronous:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg)
            self._pending = (future, step)
            logger.info(f"checkpoint step {step}: staged in {time.monotonic() - begin:.2f}s, writing in the background")
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
        future.result()
        self._commit(step)
        logger.info(f"checkpoint step {step} saved to {ckpt.step_folder(self.root, step)} (async)")

    def _commit(self, step: int) -> None:
        """Every rank has written step-N.tmp: rank 0 renames it to step-N, which makes it loadable."""
        self._maybe_stall_for_test(step)
        self._barrier()
        if self.rank == 0:
            final = ckpt.step_folder(self.root, step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(ckpt.tmp_folder(self.root, step), final)
            self._purge_old_checkpoints()
            self._remove_older_unfinished_saves(step)
        self._barrier()

    def _maybe_stall_for_test(self, step: int) -> None:
        if os.environ.get(STALL_STEP_ENV) == str(step):
            logger.info(f"test hook: stalling the save of step {step} before its rename (pid {os.getpid()})")
            time.sleep(float(os.environ.get(STALL_SECONDS_ENV, "60")))

    def _purge_old_checkpoints(self) -> None:
        k = self.c.keep_latest_k
        if k <= 0:
            return
        steps = sorted(ckpt.complete_steps(self.root))
        for step in steps[:-k]:
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

    def export_hf(self, step: int) -> None:
        """last_save_in_hf: a Hugging Face folder {dump_folder}/{folder}/step-N-hf (collective)."""
        try:
            from titan_lite.checkpoint.hf import export_hf
        except ImportError as exc:
            raise ConfigError(f"'checkpoint.last_save_in_hf' = true but HF export is unavailable ({exc})") from None
        t = self.trainer
        out = self.root / f"step-{step}-hf"
        export_hf(t.model_parts, t.model_args, str(out), getattr(torch, self.c.export_dtype),
                  self.cfg.model.hf_assets_path, t.parallel_dims)
        logger.info(f"Hugging Face export of step {step} written to {out}")

    def finish(self) -> None:
        """Wait for a background save so that no checkpoint is left half-written at exit."""
        self.wait_for_pending_save()

    # -------------------------------------------------------------------------------- load

    def load(self) -> None:
        """Resume from this run's newest complete checkpoint (or load_step), else from the initial load path."""
        if self.enabled:
            self._warn_incomplete()
        source = source_to_load(self.cfg)
        if source is None:
            return
        kind, path = source
        if kind == "resume":
            self._load_folder(path, model_only=False)
        elif kind == "hf":
            self._load_hf(str(path))
        else:
            self._load_folder(path, model_only=self.c.initial_load_model_only)

    def _warn_incomplete(self) -> None:
        if self.rank != 0:
            return
        for folder in ckpt.incomplete_folders(self.root):
            logger.warning(f"skipping incomplete checkpoint '{folder}': its save never finished")

    def _load_hf(self, folder: str) -> None:
        from titan_lite.checkpoint.hf import load_hf_weights

        load_hf_weights(self.trainer.model_parts, folder, self.trainer.model_args)
        logger.info(f"loaded Hugging Face weights from {folder}")

    def _load_folder(self, folder: Path, model_only: bool) -> None:
        metadata = ckpt.read_metadata(folder)
        wanted = self._components_to_load(metadata, model_only)
        state = self._placeholders(wanted, metadata, folder)
        if not state:
            logger.info(f"nothing loaded from checkpoint {folder}: every part of it is excluded")
            return
        dcp.load(state, checkpoint_id=str(folder), process_group=self.pg)
        self._apply(state)
        logger.info(f"loaded checkpoint {folder} ({', '.join(sorted(state))}); "
                    f"resuming after step {self.trainer.train_state.step}")

    def _components_to_load(self, metadata, model_only: bool) -> set[str]:
        excluded = set(self.c.exclude_from_loading)
        if model_only:
            return {"model"} - excluded
        present = {name for name in LOADABLE if self._present(metadata, name)}
        if present == {"model"} and self.rank == 0:
            logger.warning("this checkpoint holds model weights only (a seed checkpoint, or a final save with "
                           "last_save_model_only): optimizer, LR schedule, data position and step start fresh")
        return present - excluded

    def _present(self, metadata, name: str) -> bool:
        if name == "dataloader":
            return bool(ckpt.components_matching(metadata, "dataloader_dp"))
        if name == "rng":
            return bool(ckpt.components_matching(metadata, "rng_rank"))
        return ckpt.has_component(metadata, name)

    def _placeholders(self, wanted: set[str], metadata, folder: Path) -> dict[str, Any]:
        """The state to load into: current tensors give DCP the target shapes and shardings."""
        t = self.trainer
        state: dict[str, Any] = {}
        if "model" in wanted:
            state["model"] = ckpt.model_state_dict(t.model_parts)
            ckpt.check_tensors_match(folder, metadata, state["model"], "model")
        if "optimizer" in wanted:
            state["optimizer"] = ckpt.optimizer_state_dict(t.model_parts, t.optimizer)
            ckpt.check_tensors_match(folder, metadata, state["optimizer"], "optimizer")
        for name in ("lr_scheduler", "train_state"):
            if name in wanted:
                state[name] = b""
        if "dataloader" in wanted and self._dataloader_resumable(metadata, folder):
            state[self._dataloader_key()] = b""
        if "rng" in wanted and self._rng_key() in ckpt.components_matching(metadata, "rng_rank"):
            state[self._rng_key()] = b""
        elif "rng" in wanted and self.rank == 0:
            logger.info(f"checkpoint {folder} holds RNG states of another world size; RNGs keep this run's seeds")
        return state

    def _dataloader_resumable(self, metadata, folder: Path) -> bool:
        """The data position is per data-parallel rank and cannot be split differently: on another dp degree
        the data restarts from the beginning."""
        saved = ckpt.components_matching(metadata, "dataloader_dp")
        if self._dataloader_key() in saved:
            return True
        if self.rank == 0:
            saved_degree = saved[0].rsplit("_of_", 1)[1]
            logger.warning(f"checkpoint {folder} was saved with data-parallel degree {saved_degree}, this run has "
                           f"{self._dp_rank_and_degree()[1]}: a data position cannot be resharded, so the data loader "
                           f"restarts from the beginning of the dataset")
        return False

    def _apply(self, state: dict[str, Any]) -> None:
        t = self.trainer
        if "model" in state:
            ckpt.load_model_state_dict(t.model_parts, state["model"])
        if "optimizer" in state:
            ckpt.load_optimizer_state_dict(t.model_parts, t.optimizer, state["optimizer"])
        if "lr_scheduler" in state:
            t.lr_schedule.load_state_dict(ckpt.unpack(state["lr_scheduler"]))
        if "train_state" in state:
            t.train_state.load_state_dict(ckpt.unpack(state["train_state"]))
        if self._dataloader_key() in state:
            t.dataloader.load_state_dict(ckpt.unpack(state[self._dataloader_key()]))
        if self._rng_key() in state:
            self._set_rng_state(ckpt.unpack(state[self._rng_key()]))


# ------------------------------------------------------------------------------ before launch


def source_to_load(cfg: JobConfig) -> tuple[str, Path] | None:
    """What a run starts from: ("resume", its own newest complete step or load_step), else ("hf", the HF folder)
    or ("initial", a DCP folder), else None (keep the fresh init)."""
    c = cfg.checkpoint
    if c.create_seed_checkpoint:
        return None
    root = Path(cfg.job.dump_folder) / c.folder
    if c.enable:
        if c.load_step != -1:
            folder = ckpt.step_folder(root, c.load_step)
            if not folder.is_dir() and ckpt.tmp_folder(root, c.load_step).is_dir():
                raise ConfigError(f"'checkpoint.load_step' = {c.load_step}: the save of '{folder}' never finished "
                                  f"(only '{ckpt.tmp_folder(root, c.load_step)}' exists)")
            if not folder.is_dir():
                raise ConfigError(f"'checkpoint.load_step' = {c.load_step}: checkpoint folder '{folder}' does not exist")
            return "resume", folder
        complete = ckpt.complete_steps(root)
        if complete:
            return "resume", complete[max(complete)]
    if c.initial_load_in_hf:
        folder = c.initial_load_path or cfg.model.hf_assets_path
        if not folder:
            raise ConfigError("'checkpoint.initial_load_in_hf' = true needs 'checkpoint.initial_load_path' or "
                              "'model.hf_assets_path' to name a Hugging Face folder")
        return "hf", Path(folder)
    if c.initial_load_path:
        return "initial", Path(c.initial_load_path)
    return None


def check_source_before_launch(cfg: JobConfig, model_args) -> None:
    """Read only headers and metadata of what the run will load, so a missing, corrupt or mismatched checkpoint is
    one line before any process starts. Transforms may rename or reshape parameters: then the run itself checks."""
    source = source_to_load(cfg)
    if source is None or cfg.model.converters:
        return
    from titan_lite.checkpoint.hf import check_hf_folder, expected_shapes

    kind, path = source
    if kind == "hf":
        check_hf_folder(str(path), model_args)
        return
    metadata = ckpt.read_metadata(path)
    if not ckpt.has_component(metadata, "model"):
        raise ConfigError(f"checkpoint '{path}' holds no model weights")
    with torch.device("meta"):
        wanted = {name: torch.empty(shape) for name, shape in expected_shapes(model_args).items()}
    ckpt.check_tensors_match(path, metadata, wanted, "model")
