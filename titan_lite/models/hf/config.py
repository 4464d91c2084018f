"""config.json <-> LlamaArgs for the families of models/hf/families.py: the keys every family shares here, the
family's own through its row; the check of a model's args against a folder's config.json, and the flavor a
config.json describes."""

import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.flavors import FLAVORS
from titan_lite.models.hf.families import (
    ARCHITECTURES,
    FAMILIES,
    FIXED_DEFAULTS,
    MODEL_TYPE_ALIASES,
    MOE_FAMILIES,
    WINDOW_FAMILIES,
    expect_value,
    require_key,
    text_config_of,
)
from titan_lite.models.hf.rope import ROPE_FIELDS, layer_type_rope_entries, rope_fields
from titan_lite.models.parts.mixers import MIXERS, check_layer_types


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16, as config.json spells it."""
    return str(dtype).removeprefix("torch.")


def check_family_options(args: LlamaArgs, source: str = "model args") -> None:
    """The options a family's HF class has: qwen2 has q/k/v biases, qwen3 q/k norms, mistral alone a window."""
    if args.family not in ARCHITECTURES:
        raise ConfigError(f"{source}: family '{args.family}' is not one of {', '.join(ARCHITECTURES)}")
    family = FAMILIES[args.family]
    expected = {"qkv_bias": family.qkv_bias, "qk_norm": family.qk_norm,
                **{option: family.fixed.get(option, value) for option, value in FIXED_DEFAULTS.items()}}
    if not family.hybrid:
        expected["rope_partial_factor"] = 1.0
    for option, value in expected.items():
        if getattr(args, option) != value:
            raise ConfigError(f"{source}: {option} = {getattr(args, option)} cannot be written as a "
                              f"{ARCHITECTURES[args.family]}, which has {option} = {value}")
    for option in sorted({option for other in FAMILIES.values() for option in other.options}):
        if getattr(args, option) is not None and option not in family.options:
            raise ConfigError(f"{source}: {option} = {getattr(args, option)} cannot be written as a "
                              f"{ARCHITECTURES[args.family]}, which has none")
    if args.n_experts and not family.moe:
        raise ConfigError(f"{source}: {args.n_experts} experts cannot be written as a {ARCHITECTURES[args.family]}, "
                          f"which has none; MoE families: {', '.join(MOE_FAMILIES)}")
    if family.check is not None:
        family.check(args, source)
    if args.sliding_window is not None and not family.window:
        writers = " or ".join(ARCHITECTURES[f] for f in WINDOW_FAMILIES)
        raise ConfigError(f"{source}: a sliding window is written only as a {writers}, not a "
                          f"{ARCHITECTURES[args.family]}")
    if len(set(args.schedule)) > 1 and not family.hybrid:
        raise ConfigError(f"{source}: layer_types mixes {sorted(set(args.schedule))}, which a "
                          f"{ARCHITECTURES[args.family]} cannot write: it attends the same way in every layer")


def args_to_hf_config(args: LlamaArgs, dtype: torch.dtype, rope_form: str = "rope_scaling") -> dict:
    """The config.json of the args' family (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    Qwen3MoeForCausalLM, MistralForCausalLM or MixtralForCausalLM); rope in `rope_form`: the `rope_scaling` form HF
    Hub configs use, or `rope_parameters`."""
    check_family_options(args)
    config = {
        "architectures": [ARCHITECTURES[args.family]],
        "model_type": FAMILIES[args.family].model_type or args.family,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        **layer_type_rope_entries(args, rope_form),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": FAMILIES[args.family].hidden_act,
        **FAMILIES[args.family].write(args),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_name(dtype),
    }
    # Structurally pruned widths: not understood by transformers, kept so titan_lite can read its own export.
    for key in ("layer_n_heads", "layer_n_kv_heads", "layer_ffn_dims"):
        if getattr(args, key) is not None:
            config[key] = list(getattr(args, key))
    return config


def _family_options(cfg: dict, model_type: str, source: str) -> dict:
    """The LlamaArgs options a family's config.json sets (its row's reader, then its fixed options); a layer type no
    mixer is known by is refused in one line."""
    family = FAMILIES[model_type]
    options = family.read(cfg, source)
    for layer, kind in enumerate(cfg.get("layer_types") or []):
        if kind not in MIXERS:
            raise ConfigError(f"{source}: layer_types[{layer}] is {kind!r}; known layer types: {', '.join(MIXERS)}")
    return {**options, **{name: True for name in ("qkv_bias", "qk_norm") if getattr(family, name)}, **family.fixed}


def args_from_hf_config(cfg: dict, source: str = "config.json") -> LlamaArgs:
    """LlamaArgs of a config.json of one of the families (model_type llama, qwen2, qwen3, qwen3_moe, mistral,
    mixtral, qwen3_5, qwen3_5_moe, gpt_oss, gemma3 or their text model_types: a multimodal folder's text_config is
    read); anything the decoder cannot
    represent raises ConfigError naming the key."""
    cfg = text_config_of(cfg)
    model_type = cfg.get("model_type", "llama")
    model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"{source}: model_type is '{model_type}'; expected one of {', '.join(ARCHITECTURES)}")
    cfg = {**FAMILIES[model_type].config_defaults, **cfg}
    if FAMILIES[model_type].derived is not None:
        cfg = {**cfg, **FAMILIES[model_type].derived(cfg)}
    expect_value(cfg, "hidden_act", (FAMILIES[model_type].hidden_act,), source)
    dim, n_heads = int(require_key(cfg, "hidden_size", source)), int(require_key(cfg, "num_attention_heads", source))
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim {head_dim} is odd; rotary embeddings rotate pairs of channels")
    args = LlamaArgs(
        dim=dim, n_layers=int(require_key(cfg, "num_hidden_layers", source)), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        vocab_size=int(require_key(cfg, "vocab_size", source)),
        ffn_dim=int(require_key(cfg, "intermediate_size", source)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_n_heads=cfg.get("layer_n_heads"), layer_n_kv_heads=cfg.get("layer_n_kv_heads"),
        layer_ffn_dims=cfg.get("layer_ffn_dims"), explicit_head_dim=None if head_dim == dim // n_heads else head_dim,
        family=model_type, **_family_options(cfg, model_type, source), **rope_fields(cfg, source))
    check_layer_types(args, source)
    return args


def read_hf_config(config_path: str | Path) -> dict:
    """The parsed config.json; a missing or malformed file raises ConfigError naming it."""
    path = Path(config_path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; expected a Hugging Face config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


# Fields compared by check_args_against_hf_config; max_seq_len is left out (training picks its own length).
_CHECKED_FIELDS = ("family", "dim", "n_layers", "n_heads", "kv_heads", "head_dim", "vocab_size", "ffn_dim",
                   "norm_eps", *ROPE_FIELDS, "tie_word_embeddings", "layer_n_heads", "layer_n_kv_heads",
                   "layer_ffn_dims", "qkv_bias", "qk_norm", "sliding_window", "schedule", "n_experts", "moe_top_k",
                   "moe_ffn_dim", "moe_norm_topk_prob", "moe_layers", "attn_output_gate", "norm_unit_offset",
                   "rope_partial_factor", "linear_n_key_heads", "linear_n_value_heads", "linear_key_head_dim",
                   "linear_value_head_dim", "linear_conv_kernel", "attn_sinks", "attn_out_bias", "moe_router",
                   "moe_router_bias", "expert_act", "expert_bias", "swiglu_alpha", "swiglu_limit", "sandwich_norms",
                   "embed_scale", "ffn_activation", "query_pre_attn_scalar", "rope_local_theta", "q_lora_rank",
                   "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_n_group",
                   "moe_topk_group", "moe_routed_scaling", "moe_shared_experts", "rope_interleave",
                   "moe_shared_ffn_dim")
_SCALING_FIELDS = ROPE_FIELDS[2:]


# Converted checkpoints often store float settings rounded to float32 (rms_norm_eps 9.999999747378752e-06 for 1e-5):
# floats agree within a relative 1e-6 (float32 keeps about 7 significant digits).
FLOAT_REL_TOL = 1e-6


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=FLOAT_REL_TOL)
    return a == b


def check_args_against_hf_config(args: LlamaArgs, config_path: str, rope: bool = True) -> None:
    """Raise ConfigError naming the first field where the model args and the HF config.json disagree (`rope`
    False: the rope settings may differ)."""
    expected = args_from_hf_config(read_hf_config(config_path), source=str(config_path))
    for name in _CHECKED_FIELDS if rope else [f for f in _CHECKED_FIELDS if f not in ROPE_FIELDS]:
        if name in _SCALING_FIELDS and args.rope_scaling_factor is None and expected.rope_scaling_factor is None:
            continue  # the scaling details mean nothing without scaling
        ours, theirs = getattr(args, name), getattr(expected, name)
        if not _same(ours, theirs):
            label = {"kv_heads": "n_kv_heads", "schedule": "layer_types"}.get(name, name)
            raise ConfigError(f"model args disagree with {config_path}: {label} is {ours!r} in the model "
                              f"but {theirs!r} in config.json")


def flavor_of_hf_config(config_path: str | Path) -> str:
    """The flavor whose shapes a config.json describes (the first in FLAVORS); ConfigError when none does."""
    for name, args in FLAVORS.items():
        try:
            check_args_against_hf_config(replace(args), str(config_path))
        except ConfigError:
            continue
        return name
    raise ConfigError(f"{config_path} describes none of titan_lite's flavors ({', '.join(FLAVORS)}); "
                      "name one that matches it")
