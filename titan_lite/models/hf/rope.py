"""Rotary settings in config.json, both ways: transformers 4's rope_theta + rope_scaling and 5's rope_parameters,
read into the LlamaArgs rope fields (a rope type titan_lite cannot compute, or a value transformers would refuse, is a
ConfigError naming the file and its key) and written back in either form."""

import json
import math

from titan_lite.errors import ConfigError
from titan_lite.models.args import ROPE_SCALING_TYPES, LlamaArgs
from titan_lite.models.hf.families import require_key

# The rope fields; those after the factor mean nothing without scaling.
ROPE_FIELDS = ("rope_theta", "rope_scaling_factor", "rope_scaling_type", "rope_low_freq_factor",
               "rope_high_freq_factor", "rope_original_max_seq_len", "rope_beta_fast", "rope_beta_slow",
               "rope_truncate", "rope_attention_factor", "rope_mscale", "rope_mscale_all_dim")

# yarn's optional keys with transformers' defaults: an export writes only those that differ, as published configs do.
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "attention_factor": None, "mscale": None,
                  "mscale_all_dim": None}


def _rope_scaling_of(args: LlamaArgs) -> dict | None:
    """The args' scaling as transformers' rope parameters (without rope_theta), or None for plain RoPE."""
    if args.rope_scaling_factor is None:
        return None
    kind, factor = args.rope_scaling_type, float(args.rope_scaling_factor)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    scaling = {"rope_type": kind, "factor": factor,
               "original_max_position_embeddings": int(args.rope_original_max_seq_len)}
    if kind == "llama3":
        return {**scaling, "low_freq_factor": float(args.rope_low_freq_factor),
                "high_freq_factor": float(args.rope_high_freq_factor)}
    values = {"beta_fast": float(args.rope_beta_fast), "beta_slow": float(args.rope_beta_slow),
              "truncate": args.rope_truncate, "attention_factor": args.rope_attention_factor,
              "mscale": args.rope_mscale, "mscale_all_dim": args.rope_mscale_all_dim}
    return {**scaling, **{k: v for k, v in values.items() if v != _YARN_DEFAULTS[k]}}


# config.json's two ways of writing rope: transformers 4 and the published Hub configs (top-level rope_theta, and
# rope_scaling null or a dict), transformers 5 (rope_parameters, rope_theta inside).
ROPE_FORMS = ("rope_scaling", "rope_parameters")


def rope_form_of(cfg: dict) -> str:
    """Which of ROPE_FORMS a config.json uses (rope_scaling when it has neither)."""
    return "rope_parameters" if cfg.get("rope_parameters") and not cfg.get("rope_scaling") else "rope_scaling"


def rope_entries(args: LlamaArgs, form: str) -> dict:
    """The rope keys of a config.json in `form`; a partial rotation's factor where it rotates part of each head."""
    scaling = _rope_scaling_of(args)
    partial = {"partial_rotary_factor": args.rope_partial_factor} if args.rope_partial_factor != 1.0 else {}
    if form == "rope_parameters":
        return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": float(args.rope_theta),
                                    **partial}}
    return {"rope_theta": float(args.rope_theta), "rope_scaling": scaling, **partial}


def layer_type_rope_entries(args: LlamaArgs, form: str) -> dict:
    """rope_entries, with the sliding layers' own base where they have one (Gemma 3): rope_local_base_freq beside
    the rope_scaling form, or rope_parameters per layer type ("full_attention", "sliding_attention")."""
    entries = rope_entries(args, form)
    if args.rope_local_theta is None:
        return entries
    local = float(args.rope_local_theta)
    if form == "rope_scaling":
        return {**entries, "rope_local_base_freq": local}
    return {"rope_parameters": {"full_attention": entries["rope_parameters"],
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}}}


_DYNAMIC_REFUSED = ("its frequencies follow the longest sequence seen so far (transformers recomputes them whenever a "
                    "longer one arrives), so a trained model has no fixed rotation per position; use 'yarn' or "
                    "'linear'")


def _rope_entry(cfg: dict, source: str) -> tuple[str, dict]:
    """Which of ROPE_FORMS holds the scaling (rope_scaling when it has one) and its object ({} for plain RoPE); a
    value that is no object (or null) is a ConfigError naming the key."""
    for key in ROPE_FORMS:
        value = cfg.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{source}: '{key}' is {json.dumps(value)}; expected an object such as "
                              '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, '
                              "or null for plain RoPE")
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    return key, cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


# Keys of a scaling object and what each must hold (the rope type's own keys; rope_theta and rope_type apart).
_ROPE_NUMBERS = {"factor": 1.0, "low_freq_factor": 0.0, "high_freq_factor": 0.0, "beta_fast": 0.0, "beta_slow": 0.0,
                 "attention_factor": 0.0, "mscale": 0.0, "mscale_all_dim": 0.0,
                 "original_max_position_embeddings": 1.0}  # the smallest value each may take


def _checked_number(scaling: dict, name: str, where: str) -> None:
    value = scaling.get(name)
    if value is None:
        return
    low = _ROPE_NUMBERS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise ConfigError(f"{where}: '{name}' is {json.dumps(value)}; expected a number of at least {low:g}"
                          + (" (the factor the context grows by)" if name == "factor" else ""))


def rope_fields(cfg: dict, source: str) -> dict:
    """The LlamaArgs rope fields of a config.json, from transformers 4 (rope_theta + rope_scaling) or 5
    (rope_parameters, rope_theta inside) configs; a rope type titan_lite cannot compute, or a value transformers
    would refuse, is a ConfigError naming the file and its key."""
    per_type = cfg.get("rope_parameters")
    if isinstance(per_type, dict) and isinstance(per_type.get("full_attention"), dict):
        # rope_parameters per layer type (Gemma 3): the full layers' here, the sliding layers' read by the family
        cfg = {**cfg, "rope_parameters": per_type["full_attention"]}
    key, scaling = _rope_entry(cfg, source)
    where = f"{source}: '{key}'"
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ConfigError(f"{source}: 'rope_theta' is {json.dumps(theta)}; expected a positive number")
    fields = {"rope_theta": float(theta)}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    for name in _ROPE_NUMBERS:
        _checked_number(scaling, name, where)
    if rope_type is None and scaling.get("factor") is not None:
        raise ConfigError(f"{where} has 'factor' {json.dumps(scaling['factor'])} but no 'rope_type' (or 'type'), so "
                          "it would evaluate as plain RoPE: name the scaling ('linear', 'llama3' or 'yarn'), or drop "
                          "'factor'")
    rope_type = "default" if rope_type is None else rope_type
    if rope_type == "default":
        return fields
    if rope_type == "dynamic":
        raise ConfigError(f"{where}: rope type 'dynamic' is not supported: {_DYNAMIC_REFUSED}")
    if rope_type not in ROPE_SCALING_TYPES:
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported; expected 'default', "
                          f"{', '.join(repr(t) for t in ROPE_SCALING_TYPES)}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor {scaling['partial_rotary_factor']}; titan_lite rotates "
                          "every channel of a head (1.0)")
    fields |= {"rope_scaling_type": rope_type, "rope_scaling_factor": float(require_key(scaling, "factor", where))}
    own_fields = {"llama3": _llama3_fields, "yarn": _yarn_fields}.get(rope_type)  # linear has none of its own
    return fields | own_fields(scaling, where) if own_fields else fields


def _llama3_fields(scaling: dict, where: str) -> dict:
    return {"rope_low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
            "rope_high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
            "rope_original_max_seq_len": int(scaling.get("original_max_position_embeddings", 8192))}


def _yarn_fields(scaling: dict, where: str) -> dict:
    if scaling.get("original_max_position_embeddings") is None:
        raise ConfigError(f"{where}: rope type 'yarn' needs 'original_max_position_embeddings' (the context "
                          "length the model was pre-trained with, e.g. 32768 for Qwen2.5/Qwen3)")
    if not isinstance(scaling.get("truncate", True), bool):
        raise ConfigError(f"{where}: 'truncate' is {json.dumps(scaling['truncate'])}; expected true or false")
    optional = {k: scaling[k] if scaling.get(k) is not None else v for k, v in _YARN_DEFAULTS.items()}
    return {"rope_original_max_seq_len": int(scaling["original_max_position_embeddings"]),
            "rope_beta_fast": float(optional["beta_fast"]), "rope_beta_slow": float(optional["beta_slow"]),
            "rope_truncate": bool(optional["truncate"]),
            **{f"rope_{k}": _float(optional, k) for k in ("attention_factor", "mscale", "mscale_all_dim")}}


def _float(values: dict, key: str) -> float | None:
    return None if values[key] is None else float(values[key])
