"""The LoRA transform's adapters as PEFT folders: their adapter_config.json, PiSSA's conversion to a plain LoRA of
twice the rank on the original base, merging into plain weights, loading a PEFT adapter (checked against [lora]
before launch), and the [lora] settings that reproduce a PEFT adapter (for the scripts)."""

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch

from titan_lite.checkpoint.hf import expected_shapes
from titan_lite.checkpoint.peft import (
    ADAPTER_CONFIG,
    PeftAdapter,
    adapter_tensor_shapes,
    check_peft_config,
    hf_module,
    other_base_line,
    titan_tensor_name,
)
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.transforms.lora.module import ADAPTER_PARAMS, PISSA_INIT_PARAMS, merged_weight
from titan_lite.transforms.lora.options import FEED_FORWARD, FULL_MODULES, PROJECTIONS, AdapterSpec, LoraOptions
from titan_lite.transforms.lora.sparse import adapter_keeps_sparsity


def module_of(name: str) -> tuple[str, str]:
    """layers.0.attention.wq.lora_a -> (layers.0.attention.wq, lora_a)."""
    module, _, param = name.rpartition(".")
    return module, param


def adapted_modules_of(state: dict[str, torch.Tensor]) -> list[str]:
    return [module_of(n)[0] for n in state if n.endswith(".lora_a")]


# ------------------------------------------------------------------------------------------ merge and convert


def merge_adapters(state: dict[str, torch.Tensor], specs: dict[str, AdapterSpec],
                   keep_sparsity: bool = False) -> dict[str, torch.Tensor]:
    """A plain Llama state dict: each adapted weight replaced by its merged weight (computed in float32, kept in
    the weight's dtype), adapter tensors dropped. `specs` gives each adapted module's scale; keep_sparsity masks
    each update by its weight's zeros."""
    out = dict(state)
    for module in adapted_modules_of(state):
        magnitude, weight = out.pop(f"{module}.magnitude", None), out[f"{module}.weight"]
        out[f"{module}.weight"] = merged_weight(weight, out.pop(f"{module}.lora_a"), out.pop(f"{module}.lora_b"),
                                                specs[module].scale, magnitude, keep_sparsity).to(weight.dtype)
    for name in [n for n in out if module_of(n)[1] in PISSA_INIT_PARAMS]:
        del out[name]
    return out


def pissa_as_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PiSSA's trained (A, B) with its initial (A0, B0) as a plain LoRA of rank 2r on the ORIGINAL weight W:
    W_res + s B A = W + s (B A - B0 A0) = W + s [B, -B0] [A; A0]."""
    out = {}
    for name, tensor in state.items():
        module, param = module_of(name)
        if param == "lora_a":
            out[name] = torch.cat([tensor, state[f"{module}.pissa_a0"]], dim=0)
        elif param == "lora_b":
            out[name] = torch.cat([tensor, -state[f"{module}.pissa_b0"]], dim=1)
        elif param not in PISSA_INIT_PARAMS:
            out[name] = tensor
    return out


def without_pissa_init(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in state.items() if module_of(n)[1] not in PISSA_INIT_PARAMS}


# ------------------------------------------------------------------------------------------ adapter_config.json


# Families whose adapters on gate_proj / up_proj / down_proj peft (0.21, on transformers 5) takes for the routed
# experts' fused parameters (its v4 -> v5 config rewrite): their dense and shared-expert MLPs are written as
# target_parameters on each Linear's weight instead (PEFT's ParamWrapper: the same tensors, LoRA only, no DoRA).
MLP_AS_PARAMETERS = ("deepseek_v3",)


def mlp_target_parameters(modules: list[str]) -> list[str]:
    """target_parameters for the adapted dense and shared-expert MLP linears (mlp.gate_proj.weight,
    mlp.shared_experts.down_proj.weight, ...)."""
    return sorted({hf_module(m).split(".", 3)[3] + ".weight" for m in modules if module_of(m)[1] in FEED_FORWARD})


def peft_config(options: LoraOptions, modules: list[str], base_model: str | None, doubled: bool = False,
                mlp_as_parameters: bool = False) -> dict:
    """adapter_config.json for these adapted modules. Ranks and alphas that differ from the section's go into
    rank_pattern / alpha_pattern under each module's full HF name. `doubled`: PiSSA's rank-2r conversion, whose
    alphas keep every module's scale (x2 for alpha / r, x sqrt(2) for rsLoRA). `mlp_as_parameters`: the MLP
    linears as target_parameters (MLP_AS_PARAMETERS)."""
    c = options.section
    rank_factor = 2 if doubled else 1
    alpha_factor = (math.sqrt(2) if c.use_rslora else 2.0) if doubled else 1.0
    rank_pattern, alpha_pattern = {}, {}
    for module in modules:
        spec = options.spec(module)
        key = re.escape(hf_module(module))
        if spec.rank != c.rank:
            rank_pattern[key] = spec.rank * rank_factor
        if spec.alpha != c.alpha:
            alpha_pattern[key] = spec.alpha * alpha_factor
    as_parameters = mlp_target_parameters(modules) if mlp_as_parameters else []
    targets = sorted({PROJECTIONS[module_of(m)[1]][1] for m in modules
                      if not (as_parameters and module_of(m)[1] in FEED_FORWARD)})
    saved = [FULL_MODULES.get(m) or PROJECTIONS[m][1] for m in options.train_modules]
    extra = {"target_parameters": as_parameters} if as_parameters else {}
    return {**extra,
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": c.rank * rank_factor, "lora_alpha": c.alpha * alpha_factor, "use_rslora": c.use_rslora,
        "use_dora": c.use_dora, "lora_dropout": c.dropout, "target_modules": targets,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "modules_to_save": saved or None,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
    }


# ------------------------------------------------------------------------------------------ loading


def expected_adapter_shapes(options: LoraOptions, args: LlamaArgs) -> dict[str, list[int]]:
    """titan_lite name -> shape of every tensor a PEFT adapter for this [lora] section must hold."""
    out = {}
    for module, (fan_in, fan_out) in options.adapted_modules(args).items():
        rank = options.spec(module).rank
        out[f"{module}.lora_a"], out[f"{module}.lora_b"] = [rank, fan_in], [fan_out, rank]
        if options.section.use_dora:
            out[f"{module}.magnitude"] = [fan_out]
    for name, shape in expected_shapes(args).items():
        if options.is_train_module(module_of(name)[0]):
            out[name] = list(shape)
    return out


def read_adapter_config(folder: str | Path) -> dict:
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise ConfigError(f"'lora.adapter_path' = '{folder}' has no {ADAPTER_CONFIG}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    check_peft_config(config, str(path))
    return config


def check_adapter_matches(options: LoraOptions, args: LlamaArgs, folder: str) -> None:
    """The PEFT adapter at lora.adapter_path fits this [lora] section and model: the same tensors with the same
    shapes, the same scale per module, DoRA or not. Reads the config and the safetensors header only."""
    config = read_adapter_config(folder)
    if bool(config.get("use_dora")) != options.section.use_dora:
        raise ConfigError(f"'lora.use_dora' = {str(options.section.use_dora).lower()} but the adapter at '{folder}' "
                          f"has use_dora = {str(bool(config.get('use_dora'))).lower()}")
    found = {titan_tensor_name(k, folder): shape for k, shape in adapter_tensor_shapes(folder).items()}
    wanted = expected_adapter_shapes(options, args)
    for name in wanted:
        if name not in found:
            raise ConfigError(f"the adapter at '{folder}' has no tensor for '{name}': its target_modules / "
                              "modules_to_save differ from 'lora.target_modules' / 'lora.train_modules'")
        if found[name] != wanted[name]:
            raise ConfigError(f"the adapter at '{folder}' holds '{name}' with shape {found[name]}, but [lora] "
                              f"(rank, rank_pattern) and the model give {wanted[name]}")
    extra = sorted(set(found) - set(wanted))
    if extra:
        raise ConfigError(f"the adapter at '{folder}' holds '{extra[0]}', which [lora] neither adapts nor trains")
    adapter = PeftAdapter(config, {})
    for module in options.adapted_modules(args):
        theirs, ours = adapter.scale(hf_module(module)), options.spec(module).scale
        if not math.isclose(theirs, ours, rel_tol=1e-6):
            raise ConfigError(f"'lora.alpha' / 'lora.use_rslora' / 'lora.alpha_pattern' give {module} the scale "
                              f"{ours:.6g}, but the adapter at '{folder}' gives {theirs:.6g}")


def apply_peft_adapter(cfg, folder: str | Path) -> None:
    """Make `cfg` load the PEFT adapter in `folder` on top of its model: the LoRA transform with the adapter's own
    settings (what the scripts do with --adapter, without a run's config)."""
    cfg.model.converters = [*cfg.model.converters, "lora"]
    for key, value in lora_settings_from_peft(folder).items():
        setattr(cfg.lora, key, value)
    base = cfg.checkpoint.initial_load_path or cfg.model.hf_assets_path
    warning = other_base_line(folder, base) if base else None
    if warning:
        logging.getLogger("titan_lite").warning(warning)


def lora_settings_from_peft(folder: str | Path) -> dict[str, Any]:
    """[lora] values that reproduce a PEFT adapter (its targets, ranks, alphas, DoRA, modules_to_save), with
    adapter_path pointing at it, keep_sparsity on for an adapter trained with masked updates: what the scripts use
    to load an adapter without a config."""
    config = read_adapter_config(folder)
    names = [titan_tensor_name(k, str(folder)) for k in adapter_tensor_shapes(folder)]
    targets = sorted({PROJECTIONS[module_of(module_of(n)[0])[1]][1] for n in names if n.endswith(".lora_a")})
    if not targets:
        raise ConfigError(f"{folder}: the adapter holds no lora_A tensors")
    return {"rank": int(config["r"]), "alpha": float(config["lora_alpha"]),
            "use_rslora": bool(config.get("use_rslora")),
            "use_dora": bool(config.get("use_dora")), "target_modules": targets, "init": "default", "dropout": 0.0,
            "rank_pattern": [f"{k}={v}" for k, v in (config.get("rank_pattern") or {}).items()],
            "alpha_pattern": [f"{k}={v}" for k, v in (config.get("alpha_pattern") or {}).items()],
            "train_modules": list(config.get("modules_to_save") or []), "adapter_path": str(folder),
            "keep_sparsity": "on" if adapter_keeps_sparsity(folder) else "off"}


def adapter_exported_param(options: LoraOptions, name: str) -> bool:
    """Whether a model parameter belongs in an adapter export: adapters, PiSSA's initial factors, train_modules."""
    module, param = module_of(name)
    return param in ADAPTER_PARAMS or param in PISSA_INIT_PARAMS or options.is_train_module(module)



def peft_specs(adapter: PeftAdapter, modules: list[str]) -> dict[str, AdapterSpec]:
    """Each adapted module's rank, alpha and scale by the PEFT config's rules."""
    specs = {}
    for module in modules:
        rank, alpha = adapter.rank_alpha(hf_module(module))
        specs[module] = AdapterSpec(rank, alpha, adapter.scale(hf_module(module)))
    return specs
