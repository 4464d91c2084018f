"""DCP helpers: model/optimizer state over model parts, opaque per-rank blobs, checkpoint metadata and step folders."""

import io
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_lite.errors import ConfigError
from titan_lite.models.parameters import canonical_name

STEP_FOLDER = re.compile(r"^step-(\d+)$")
TMP_FOLDER = re.compile(r"^step-(\d+)\.tmp$")
TMP_SUFFIX = ".tmp"
# Flattened optimizer keys ("state.<fqn>.exp_avg") let DCP reshard optimizer state like model weights.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# ---------------------------------------------------------------- opaque blobs


def pack(obj: Any) -> bytes:
    """Small non-tensor state (schedules, data positions, RNG) as one DCP leaf, so its structure never matters."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


# ---------------------------------------------------------------- model and optimizer


def model_state_dict(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Canonical FQN -> tensor (DTensor when sharded) over every model part of this rank."""
    state: dict[str, torch.Tensor] = {}
    for part in model_parts:
        state.update(get_model_state_dict(part))
    return state


def load_model_state_dict(model_parts: list[nn.Module], state: dict[str, torch.Tensor]) -> None:
    """Load the entries of `state` that each part holds; parameters missing from `state` (not saved, e.g. a frozen
    base under adapter-only checkpoints) keep their current values."""
    for part in model_parts:
        keys = list(get_model_state_dict(part))
        own = {k: state[k] for k in keys if k in state}
        set_model_state_dict(part, own, options=StateDictOptions(strict=len(own) == len(keys)))


class _OptimizerPartView(torch.optim.Optimizer):
    """The slice of one optimizer that covers one model part, sharing the optimizer's per-parameter state.

    DSD maps optimizer parameters to FQNs through a single module, but the trainer has one optimizer over
    several pipeline stages; a view per stage lets each stage be handled on its own. Build views after the
    optimizer has state (init_optimizer_state).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, part: nn.Module):
        owned = {id(p) for p in part.parameters()}
        groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if id(p) in owned]
            if params:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        super().__init__(groups, optimizer.defaults)
        # Only this part's entries (the per-parameter dicts themselves are shared): state_dict() packs every key.
        self.state = defaultdict(dict, {p: optimizer.state[p] for g in self.param_groups for p in g["params"]
                                        if p in optimizer.state})

    def step(self, closure=None):  # never stepped: state is initialised on the real optimizer
        raise RuntimeError("an optimizer view is never stepped")


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state with a step of zero gradients at lr 0, so there is state to load into."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _optimizer_views(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    if len(model_parts) == 1:
        return [optimizer]
    init_optimizer_state(optimizer)
    return [_OptimizerPartView(optimizer, part) for part in model_parts]


def optimizer_state_dict(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Flattened, FQN-keyed optimizer state over every model part (resharding-friendly)."""
    state: dict[str, Any] = {}
    for part, view in zip(model_parts, _optimizer_views(model_parts, optimizer), strict=True):
        state.update(get_optimizer_state_dict(part, view, options=OPTIM_OPTIONS))
    return state


def load_optimizer_state_dict(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    views = _optimizer_views(model_parts, optimizer)
    for part, view in zip(model_parts, views, strict=True):
        set_optimizer_state_dict(part, view, state, options=OPTIM_OPTIONS)
        if view is not optimizer:  # load_state_dict gave the view a fresh state dict: copy it back
            for group in view.param_groups:
                for p in group["params"]:
                    optimizer.state[p] = view.state[p]


# ---------------------------------------------------------------- metadata and checks


def read_metadata(folder: Path) -> Metadata:
    """The DCP metadata of a checkpoint folder; a missing or unreadable folder is a ConfigError naming it."""
    if not folder.is_dir():
        raise ConfigError(f"checkpoint folder '{folder}' does not exist")
    if not (folder / ".metadata").is_file():
        raise ConfigError(f"checkpoint folder '{folder}' is incomplete or not a DCP checkpoint (no .metadata file)")
    try:
        return dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unpickling/IO failure means the same thing to the user
        raise ConfigError(f"checkpoint folder '{folder}' is corrupt: "
                          f"cannot read its .metadata ({type(exc).__name__})") from None


def check_storage_files(folder: Path, metadata: Metadata) -> None:
    """Every data file the metadata points into exists and is long enough: a truncated or missing shard (a disk that
    filled up, a copy that stopped) is one line naming it, before any tensor is read."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            needed[path] = max(needed.get(path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            raise ConfigError(f"checkpoint '{folder}' is incomplete: its data file '{name}' is missing")
        actual = path.stat().st_size
        if actual < size:
            raise ConfigError(f"checkpoint '{folder}' is truncated: '{name}' has {actual:,} bytes, its metadata needs "
                              f"{size:,}")


def has_component(metadata: Metadata, name: str) -> bool:
    """Whether the checkpoint holds top-level state `name` (DCP flattens nested keys with dots)."""
    return any(k == name or k.startswith(name + ".") for k in metadata.state_dict_metadata)


def components_matching(metadata: Metadata, prefix: str) -> list[str]:
    return sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith(prefix)})


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)  # a DTensor's shape is the global one, as DCP stores it


def check_tensors_match(folder: Path, metadata: Metadata, state: dict[str, Any], prefix: str) -> None:
    """Every tensor to load exists in the checkpoint with the same global shape, else one line naming it."""
    saved = metadata.state_dict_metadata
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        fqn = f"{prefix}.{key}"
        entry = saved.get(fqn)
        if entry is None:
            raise ConfigError(f"checkpoint '{folder}' has no tensor '{fqn}': it was saved from a different model")
        if not isinstance(entry, TensorStorageMetadata):
            raise ConfigError(f"checkpoint '{folder}' holds '{fqn}' as a non-tensor value: "
                              "it was saved from a different model")
        if list(entry.size) != _shape(value):
            raise ConfigError(f"checkpoint '{folder}': tensor '{fqn}' has shape {list(entry.size)} in the checkpoint "
                              f"but {_shape(value)} in this model")


# ---------------------------------------------------------------- step folders


def step_folder(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def tmp_folder(root: Path, step: int) -> Path:
    return root / f"step-{step}{TMP_SUFFIX}"


def complete_steps(root: Path) -> dict[int, Path]:
    """step -> folder of the checkpoints whose save finished (renamed from .tmp after every rank wrote)."""
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        m = STEP_FOLDER.match(child.name)
        if m and child.is_dir() and (child / ".metadata").is_file():
            found[int(m.group(1))] = child
    return found


def incomplete_folders(root: Path) -> list[Path]:
    """Step folders a save started but never finished: a leftover .tmp, or a step folder without metadata."""
    if not root.is_dir():
        return []
    bad = []
    for child in sorted(root.iterdir()):
        if TMP_FOLDER.match(child.name) or (STEP_FOLDER.match(child.name) and not (child / ".metadata").is_file()):
            bad.append(child)
    return bad


def read_dcp_model(folder: str, prefix: str) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint (keys under `prefix`, prefix removed), read without a process group."""
    if not (Path(folder) / ".metadata").exists():
        raise ConfigError(f"{folder}: no .metadata file; expected a DCP checkpoint step folder")
    reader = FileSystemReader(folder)
    entries = reader.read_metadata().state_dict_metadata
    wanted = {key: meta for key, meta in entries.items()
              if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not wanted:
        sample = next(iter(entries), "(none)")
        raise ConfigError(f"{folder}: no tensors under key prefix '{prefix}' (e.g. found '{sample}'); "
                          "set --key_prefix")
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in wanted.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {canonical_name(key[len(prefix):]): tensor for key, tensor in state.items()}
