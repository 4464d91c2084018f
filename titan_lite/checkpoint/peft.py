"""Hugging Face PEFT adapter folders: adapter_config.json + adapter_model.safetensors, PEFT's tensor names and
rotary layout <-> titan_lite's, and PEFT's per-module rank and alpha rules.

PEFT names an adapter tensor `base_model.model.<HF module>.lora_A.weight` (lora_B.weight, lora_magnitude_vector for
DoRA), and a fully trained module (modules_to_save) `base_model.model.<HF parameter>`. titan_lite's are
`<module>.lora_a` / `.lora_b` / `.magnitude` and the plain parameter names. q/k projections rotate interleaved pairs
in titan_lite and half-split ones in HF: their output rows (lora_B's rows, the magnitude) are permuted like the
weights (models/hf/state_dict.py).
"""

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from titan_lite.checkpoint.files import save_safetensors
from titan_lite.checkpoint.hf import SafetensorsReader, open_safetensors
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.names import LLAMA_NAMES
from titan_lite.models.hf.state_dict import tensor_from_hf, tensor_to_hf

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# titan_lite's adapter parameter names (transforms/lora) -> PEFT's, after the module name.
ADAPTER_SUFFIXES = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight", "magnitude": "lora_magnitude_vector"}
_PEFT_SUFFIXES = {peft: titan for titan, peft in ADAPTER_SUFFIXES.items()}
# Adapter tensors whose rows are the module's output rows (permuted for q/k).
_ROW_TENSORS = ("lora_b", "magnitude")
# Config keys of PEFT features titan_lite cannot represent, with the value that means "off".
_UNSUPPORTED = {"fan_in_fan_out": False, "bias": "none", "lora_bias": False, "layers_to_transform": None,
                "layers_pattern": None, "trainable_token_indices": None, "layer_replication": None,
                "target_parameters": None, "use_qalora": False, "exclude_modules": None}


@dataclass
class PeftAdapter:
    """A PEFT LoRA adapter: its config and its tensors under PEFT's names."""

    config: dict
    tensors: dict[str, torch.Tensor]

    def rank_alpha(self, hf_module: str) -> tuple[int, float]:
        """(r, lora_alpha) of one module by PEFT's rule: the first rank_pattern / alpha_pattern key whose regex
        matches the end of the module name (at a dot), else the config's r and lora_alpha."""
        rank = _pattern_value(self.config.get("rank_pattern") or {}, hf_module, self.config["r"])
        alpha = _pattern_value(self.config.get("alpha_pattern") or {}, hf_module, self.config["lora_alpha"])
        return int(rank), float(alpha)

    def scale(self, hf_module: str) -> float:
        rank, alpha = self.rank_alpha(hf_module)
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def adapted_modules(self) -> list[str]:
        """HF module names that carry lora_A tensors, in file order."""
        suffix = "." + ADAPTER_SUFFIXES["lora_a"]
        return [k[len(PREFIX):-len(suffix)] for k in self.tensors if k.endswith(suffix)]


def _pattern_value(patterns: dict, module: str, default):
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# ------------------------------------------------------------------------------------------ names and layout


def hf_module(module: str) -> str:
    """layers.0.attention.wq -> model.layers.0.self_attn.q_proj (output -> lm_head)."""
    return LLAMA_NAMES.to_hf(f"{module}.weight").removesuffix(".weight")


def titan_module(module: str) -> str:
    """model.layers.0.self_attn.q_proj -> layers.0.attention.wq (lm_head -> output)."""
    return LLAMA_NAMES.to_titan(f"{module}.weight").removesuffix(".weight")


def _rows_to_hf(module: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    rows = tensor if tensor.dim() == 2 else tensor[:, None]
    return tensor_to_hf(f"{module}.weight", rows, args).reshape(tensor.shape)


def _rows_from_hf(module: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    rows = tensor if tensor.dim() == 2 else tensor[:, None]
    return tensor_from_hf(f"{module}.weight", rows, args).reshape(tensor.shape)


def to_peft_tensors(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """titan_lite adapter (and fully trained) tensors -> PEFT's names and HF layout."""
    out = {}
    for name, tensor in state.items():
        module, _, suffix = name.rpartition(".")
        if suffix in ADAPTER_SUFFIXES:
            value = _rows_to_hf(module, tensor, args) if suffix in _ROW_TENSORS else tensor
            out[f"{PREFIX}{hf_module(module)}.{ADAPTER_SUFFIXES[suffix]}"] = value
        else:
            out[PREFIX + LLAMA_NAMES.to_hf(name)] = tensor_to_hf(name, tensor, args)
    return out


def titan_tensor_name(key: str, source: str) -> str:
    """The titan_lite name of a PEFT tensor name (layers.0.attention.wq.lora_a, output.weight, ...)."""
    if not key.startswith(PREFIX):
        raise ConfigError(f"{source}: tensor '{key}' does not start with '{PREFIX}'; not a PEFT adapter of a causal LM")
    name = key[len(PREFIX):]
    peft_suffix = next((s for s in _PEFT_SUFFIXES if name.endswith("." + s)), None)
    try:
        if peft_suffix is None:
            return LLAMA_NAMES.to_titan(name)
        return f"{titan_module(name[:-len(peft_suffix) - 1])}.{_PEFT_SUFFIXES[peft_suffix]}"
    except KeyError:
        raise ConfigError(f"{source}: tensor '{key}' belongs to no Llama module") from None


def from_peft_tensors(tensors: dict[str, torch.Tensor], args: LlamaArgs, source: str) -> dict[str, torch.Tensor]:
    """PEFT's names and HF layout -> titan_lite's; a name no Llama has is one ConfigError naming the source."""
    out = {}
    for key, tensor in tensors.items():
        name = titan_tensor_name(key, source)
        module, _, suffix = name.rpartition(".")
        if suffix in ADAPTER_SUFFIXES:
            out[name] = _rows_from_hf(module, tensor, args) if suffix in _ROW_TENSORS else tensor
        else:
            out[name] = tensor_from_hf(name, tensor, args)
    return out


# ------------------------------------------------------------------------------------------ files


def write_peft_adapter(folder: str | Path, adapter: PeftAdapter, readme: str) -> None:
    """Write adapter_config.json, adapter_model.safetensors and a README.md into `folder`, atomically."""
    out = Path(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.tensors.items()}
        save_safetensors(tensors, tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter.config, indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(readme)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_peft_adapter(folder: str | Path) -> PeftAdapter:
    """An adapter folder, checked: a LoRA adapter whose options titan_lite represents; one ConfigError line
    otherwise."""
    folder = Path(folder)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_path.is_file():
        raise ConfigError(f"{folder}: no {ADAPTER_CONFIG}; expected a PEFT adapter folder")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path}: not valid JSON ({exc})") from None
    check_peft_config(config, str(config_path))
    if not weights_path.is_file():
        other = " (adapter_model.bin is not read: save with safe_serialization)" if (
            folder / "adapter_model.bin").exists() else ""
        raise ConfigError(f"{folder}: no {ADAPTER_WEIGHTS}{other}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"{weights_path}: corrupt or truncated safetensors file ({reason})") from None
    return PeftAdapter(config, tensors)


def check_peft_config(config: dict, source: str) -> None:
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{source}: peft_type is {config.get('peft_type')!r}; titan_lite reads LORA adapters")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise ConfigError(f"{source}: '{key}' must be a positive number, got {config.get(key)!r}")
    for key, off in _UNSUPPORTED.items():
        if config.get(key, off) not in (off, [], {}):
            raise ConfigError(f"{source}: '{key}' = {config[key]!r} is not supported by titan_lite (expected {off!r})")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() != "gaussian":
        raise ConfigError(f"{source}: init_lora_weights = {init!r}: this adapter applies to a base that PEFT "
                          "re-derives when loading it (e.g. PiSSA's residual); convert it for the original base "
                          "(PEFT's path_initial_model_for_weight_conversion) first")


def other_base_line(adapter_folder: str | Path, base: str | Path) -> str | None:
    """A warning (one line) when the adapter's base_model_name_or_path names another model than the folder `base`, else
    None. The same folder, a folder named like it (a hub id's last part: 'meta-llama/Llama-3.1-8B' and
    'assets/hf/Llama-3.1-8B') or the base config.json's _name_or_path count as the same model."""
    try:
        named = json.loads((Path(adapter_folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None
    if not named:
        return None
    base = Path(base)
    try:
        recorded = json.loads((base / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError):
        recorded = None
    if (Path(named).exists() and Path(named).resolve() == base.resolve()) or named == recorded or \
            Path(named).name == base.resolve().name:
        return None
    return (f"the adapter '{adapter_folder}' was trained on '{named}' (its {ADAPTER_CONFIG}'s "
            f"base_model_name_or_path), not on '{base}': on another base of the same shapes it gives another model "
            "than the one trained")


def adapter_tensor_shapes(folder: str | Path) -> dict[str, list[int]]:
    """PEFT tensor name -> shape, read from the safetensors header only."""
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConfigError(f"{folder}: no {ADAPTER_WEIGHTS}")
    with open_safetensors(path) as handle:
        keys = list(handle.keys())
    with SafetensorsReader() as reader:
        return {key: reader.shape(path, key) for key in keys}


# ------------------------------------------------------------------------------------------ merge records

# config.json of a merged model: the adapters merged into its weights, oldest first ({"adapter", "sha256"}).
MERGED_KEY = "titan_lite_merged_adapters"


def adapter_digest(folder: str | Path) -> str:
    """sha256 of an adapter's weights file: the same adapter under another path is still the same adapter."""
    digest = hashlib.sha256()
    with open(Path(folder) / ADAPTER_WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def record_merge(model_folder: str | Path, adapter_folder: str | Path, earlier: list[dict] | None = None) -> None:
    """Note in a merged model's config.json that `adapter_folder` is merged into its weights."""
    config_path = Path(model_folder) / "config.json"
    config = json.loads(config_path.read_text())
    entry = {"adapter": str(adapter_folder), "sha256": adapter_digest(adapter_folder)}
    config[MERGED_KEY] = [*(earlier or config.get(MERGED_KEY, [])), entry]
    config_path.write_text(json.dumps(config, indent=2) + "\n")
