"""Hugging Face interop of the decoder (LlamaForCausalLM and the families that are options of it: Qwen2ForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM, MistralForCausalLM, MixtralForCausalLM): parameter names (one HF tensor per
expert for the grouped expert weights), the rotary row permutation, config.json <-> LlamaArgs."""

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from titan_lite.errors import ConfigError
from titan_lite.models.llama.args import FLAVORS, ROPE_SCALING_TYPES, LlamaArgs

# titan_lite name (with {i} for the layer) -> HF name.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",  # Qwen2/2.5
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",  # Qwen3-MoE
}
# Grouped expert weights [E, ...] (titan_lite suffix) -> the HF suffix of expert j's own tensor, {j} its index.
_EXPERT_NAMES = {
    "moe.experts.w1": "mlp.experts.{j}.gate_proj.weight",
    "moe.experts.w3": "mlp.experts.{j}.up_proj.weight",
    "moe.experts.w2": "mlp.experts.{j}.down_proj.weight",
}
# Layer suffixes a family's files spell differently from Qwen3-MoE's (the names above).
_FAMILY_SUFFIXES = {
    "mixtral": {"mlp.gate.weight": "block_sparse_moe.gate.weight",
                "mlp.experts.{j}.gate_proj.weight": "block_sparse_moe.experts.{j}.w1.weight",
                "mlp.experts.{j}.up_proj.weight": "block_sparse_moe.experts.{j}.w3.weight",
                "mlp.experts.{j}.down_proj.weight": "block_sparse_moe.experts.{j}.w2.weight"},
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TITAN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Tensors whose rows (or, for the q/k norms, entries over head_dim) are rotary channels: permuted between layouts.
_ROTARY = ("attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias",
           "attention.q_norm.weight", "attention.k_norm.weight")

# ------------------------------------------------------------------------------------------ names


@dataclass
class HFNames:
    """titan_lite <-> HF names of a Llama's parameters. A transform extends the run's copy (`Transform.hf_names`)
    with layer-level names it adds, and with patterns of names that no HF folder holds (adapters, masks)."""

    layer: dict[str, str] = field(default_factory=lambda: dict(_LAYER_NAMES))
    top: dict[str, str] = field(default_factory=lambda: dict(_TOP_NAMES))
    not_in_hf: list[re.Pattern] = field(default_factory=list)
    experts: dict[str, str] = field(default_factory=lambda: dict(_EXPERT_NAMES))

    def add_layer_name(self, titan_suffix: str, hf_suffix: str) -> None:
        """Map `layers.{i}.<titan_suffix>` to `model.layers.{i}.<hf_suffix>` both ways."""
        self.layer[titan_suffix] = hf_suffix

    def add_not_in_hf(self, pattern: str) -> None:
        """titan_lite names matching this regex (searched anywhere in the name) are not read from HF folders."""
        self.not_in_hf.append(re.compile(pattern))

    def in_hf(self, name: str) -> bool:
        return not any(p.search(name) for p in self.not_in_hf)

    def to_hf(self, name: str) -> str:
        """The HF name of a titan_lite parameter name."""
        if name in self.top:
            return self.top[name]
        match = _TITAN_LAYER.fullmatch(name)
        if match and match.group(2) in self.layer:
            return f"model.layers.{match.group(1)}.{self.layer[match.group(2)]}"
        raise KeyError(f"'{name}' is not a Llama parameter name")

    def to_titan(self, name: str) -> str:
        """The titan_lite name of an HF LlamaForCausalLM parameter name."""
        top = {hf: titan for titan, hf in self.top.items()}
        if name in top:
            return top[name]
        match = _HF_LAYER.fullmatch(name)
        layer = {hf: titan for titan, hf in self.layer.items()}
        if match and match.group(2) in layer:
            return f"layers.{match.group(1)}.{layer[match.group(2)]}"
        raise KeyError(f"'{name}' is not a LlamaForCausalLM parameter name")

    def is_grouped(self, name: str) -> bool:
        """Whether a titan_lite name is a grouped expert weight [E, ...], held by HF folders as E tensors."""
        match = _TITAN_LAYER.fullmatch(name)
        return bool(match) and match.group(2) in self.experts

    def to_hf_experts(self, name: str, n_experts: int) -> list[str]:
        """The HF names of experts 0..n_experts-1's tensors of a grouped titan_lite weight, in expert order."""
        layer, suffix = _TITAN_LAYER.fullmatch(name).groups()
        return [f"model.layers.{layer}.{self.experts[suffix].format(j=j)}" for j in range(n_experts)]

    def expert_of_hf(self, name: str) -> tuple[str, int] | None:
        """(titan_lite grouped name, expert index) of an HF per-expert tensor name; None for other names."""
        match = _HF_LAYER.fullmatch(name)
        if not match:
            return None
        for titan, pattern in self.experts.items():
            expert = re.fullmatch(re.escape(pattern).replace(r"\{j\}", r"(\d+)"), match.group(2))
            if expert:
                return f"layers.{match.group(1)}.{titan}", int(expert.group(1))
        return None

    def hf_names_of(self, name: str, n_experts: int) -> list[str]:
        """Every HF name a titan_lite parameter is written as: one, or one per expert."""
        return self.to_hf_experts(name, n_experts) if self.is_grouped(name) else [self.to_hf(name)]

    def for_family(self, family: str) -> "HFNames":
        """These names as a family's files spell them (Mixtral: block_sparse_moe.experts.{j}.w1, ...)."""
        renamed = _FAMILY_SUFFIXES.get(family)
        if not renamed:
            return self
        return replace(self, layer={t: renamed.get(h, h) for t, h in self.layer.items()},
                       experts={t: renamed.get(h, h) for t, h in self.experts.items()})


LLAMA_NAMES = HFNames()  # the plain Llama's names; extend a copy (HFNames()), never this one


def hf_name(name: str) -> str:
    """The HF name of a plain Llama parameter name."""
    return LLAMA_NAMES.to_hf(name)


def titan_name(name: str) -> str:
    """The titan_lite name of an HF LlamaForCausalLM parameter name."""
    return LLAMA_NAMES.to_titan(name)


def hf_source_names(name: str, args: LlamaArgs, names: HFNames = LLAMA_NAMES) -> list[str]:
    """HF names a titan_lite parameter may be read from, preferred first (a tied head falls back to the embedding)."""
    names = names.for_family(args.family)
    sources = [names.to_hf(name)]
    if name == "output.weight" and args.tie_word_embeddings:
        sources.append(names.to_hf("tok_embeddings.weight"))
    return sources


# ------------------------------------------------------------------------------- rotary permutation


def interleaved_to_half_split(weight: Tensor, head_dim: int) -> Tensor:
    """Reorder the output rows of a q/k projection from interleaved rotary pairs to HF's half-split layout."""
    rows, cols = weight.shape
    return weight.reshape(rows // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_split_to_interleaved(weight: Tensor, head_dim: int) -> Tensor:
    """The inverse of interleaved_to_half_split."""
    rows, cols = weight.shape
    return weight.reshape(rows // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _is_rotary(name: str) -> bool:
    return name.startswith("layers.") and name.endswith(_ROTARY)


def _permute_rows(permute, tensor: Tensor, head_dim: int) -> Tensor:
    """A rotary permutation of a 2-D tensor's rows or a 1-D tensor's entries (biases; q/k norm weights, one head)."""
    if tensor.dim() == 1:
        return permute(tensor[:, None], head_dim)[:, 0]
    return permute(tensor, head_dim)


def tensor_to_hf(name: str, tensor: Tensor, args: LlamaArgs) -> Tensor:
    """A titan_lite tensor in HF layout (q/k rows, biases and norm weights permuted; others unchanged)."""
    return _permute_rows(interleaved_to_half_split, tensor, args.head_dim) if _is_rotary(name) else tensor


def tensor_from_hf(name: str, tensor: Tensor, args: LlamaArgs) -> Tensor:
    """An HF tensor in titan_lite layout; `name` is the titan_lite name."""
    return _permute_rows(half_split_to_interleaved, tensor, args.head_dim) if _is_rotary(name) else tensor


# ----------------------------------------------------------------------------------- state dicts


def _converted_name(convert, name: str) -> str:
    try:
        return convert(name)
    except KeyError as exc:
        raise ConfigError(f"tensor {exc.args[0]}") from None


def to_hf_state_dict(sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """titan_lite names and layout -> HF; lm_head.weight is omitted when the embeddings are tied; grouped expert
    weights become one tensor per expert."""
    out, names = {}, LLAMA_NAMES.for_family(args.family)
    for name, tensor in sd.items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue
        if names.is_grouped(name):
            out.update(zip(names.to_hf_experts(name, tensor.shape[0]), tensor.unbind(0), strict=True))
            continue
        out[_converted_name(names.to_hf, name)] = tensor_to_hf(name, tensor, args)
    return out


def from_hf_state_dict(sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """HF names and layout -> titan_lite; a tied model gets output.weight from the embedding when it is absent;
    per-expert tensors are stacked into their grouped weight."""
    out, experts, names = {}, {}, LLAMA_NAMES.for_family(args.family)
    for name, tensor in sd.items():
        if name.endswith("rotary_emb.inv_freq"):  # a buffer some older checkpoints saved
            continue
        expert = names.expert_of_hf(name)
        if expert is not None:
            experts.setdefault(expert[0], {})[expert[1]] = tensor
            continue
        titan = _converted_name(names.to_titan, name)
        out[titan] = tensor_from_hf(titan, tensor, args)
    for titan, tensors in experts.items():
        if sorted(tensors) != list(range(len(tensors))):
            missing = sorted(set(range(max(tensors) + 1)) - set(tensors))
            raise ConfigError(f"tensor '{names.to_hf_experts(titan, missing[0] + 1)[-1]}' is missing")
        out[titan] = torch.stack([tensors[j] for j in range(len(tensors))])
    if args.tie_word_embeddings and "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ------------------------------------------------------------------------------------------ config


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


def _rope_entries(args: LlamaArgs, form: str) -> dict:
    scaling = _rope_scaling_of(args)
    if form == "rope_parameters":
        return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": float(args.rope_theta)}}
    return {"rope_theta": float(args.rope_theta), "rope_scaling": scaling}


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16, as config.json spells it."""
    return str(dtype).removeprefix("torch.")


# Each family's architecture and the config.json keys of its own an export writes (its options are set by the args).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
WINDOW_FAMILIES = ("mistral", "mixtral")


def _family_keys(args: LlamaArgs) -> dict:
    no_window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}
    return {
        "llama": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
        "qwen2": no_window,
        "qwen3": {"attention_bias": False, **no_window},
        "qwen3_moe": {"attention_bias": False, **no_window, **_moe_keys(args)},
        "mistral": {"sliding_window": args.sliding_window},
        # Mixtral: every layer MoE, intermediate_size the experts' width
        "mixtral": {"sliding_window": args.sliding_window, "intermediate_size": args.moe_ffn_dim,
                    "num_local_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
                    "router_aux_loss_coef": args.router_aux_loss_coef, "router_jitter_noise": 0.0,
                    "output_router_logits": False},
    }[args.family]


def _moe_keys(args: LlamaArgs) -> dict:
    return {"num_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
            "moe_intermediate_size": args.moe_ffn_dim, "norm_topk_prob": args.moe_norm_topk_prob,
            "decoder_sparse_step": args.moe_sparse_step, "mlp_only_layers": list(args.moe_dense_layers or []),
            "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": False}


def check_family_options(args: LlamaArgs, source: str = "model args") -> None:
    """The options a family's HF class has: qwen2 has q/k/v biases, qwen3 q/k norms, mistral alone a window."""
    if args.family not in ARCHITECTURES:
        raise ConfigError(f"{source}: family '{args.family}' is not one of {', '.join(ARCHITECTURES)}")
    expected = {"qkv_bias": args.family == "qwen2", "qk_norm": args.family in ("qwen3", "qwen3_moe")}
    for option, value in expected.items():
        if getattr(args, option) != value:
            raise ConfigError(f"{source}: {option} = {getattr(args, option)} cannot be written as a "
                              f"{ARCHITECTURES[args.family]}, which has {option} = {value}")
    if args.n_experts and args.family not in MOE_FAMILIES:
        raise ConfigError(f"{source}: {args.n_experts} experts cannot be written as a {ARCHITECTURES[args.family]}, "
                          f"which has none; MoE families: {', '.join(MOE_FAMILIES)}")
    if args.family == "mixtral":
        _check_mixtral_options(args, source)
    if args.sliding_window is not None and args.family not in WINDOW_FAMILIES:
        raise ConfigError(f"{source}: a sliding window is written only as a MistralForCausalLM or "
                          f"MixtralForCausalLM, not a {ARCHITECTURES[args.family]}")


def _check_mixtral_options(args: LlamaArgs, source: str) -> None:
    """MixtralForCausalLM: every layer MoE of one width, the top-k weights always renormalised."""
    differs = {"moe_norm_topk_prob": (args.moe_norm_topk_prob, True),
               "MoE layers": (args.moe_layers, list(range(args.n_layers))),
               "moe_ffn_dim": (args.moe_ffn_dim, args.ffn_dim)}
    for option, (ours, mixtral) in differs.items():
        if ours != mixtral:
            raise ConfigError(f"{source}: {option} = {ours} cannot be written as a MixtralForCausalLM, which has "
                              f"{mixtral}")


def args_to_hf_config(args: LlamaArgs, dtype: torch.dtype, rope_form: str = "rope_scaling") -> dict:
    """The config.json of the args' family (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    Qwen3MoeForCausalLM, MistralForCausalLM or MixtralForCausalLM); rope in `rope_form`: the `rope_scaling` form HF
    Hub configs use, or `rope_parameters`."""
    check_family_options(args)
    config = {
        "architectures": [ARCHITECTURES[args.family]],
        "model_type": args.family,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        **_rope_entries(args, rope_form),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        **_family_keys(args),
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


def _require(cfg: dict, key: str, source: str):
    if key not in cfg:
        raise ConfigError(f"{source}: missing '{key}'")
    return cfg[key]


def _expect(cfg: dict, key: str, allowed: tuple, source: str) -> None:
    if key in cfg and cfg[key] not in allowed:
        model = ARCHITECTURES.get(cfg.get("model_type", "llama"), "Llama")
        raise ConfigError(f"{source}: '{key}' is {cfg[key]!r}; titan_lite's {model} supports only {allowed[0]!r}")


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


def _rope_fields(cfg: dict, source: str) -> dict:
    """The LlamaArgs rope fields of a config.json, from transformers 4 (rope_theta + rope_scaling) or 5
    (rope_parameters, rope_theta inside) configs; a rope type titan_lite cannot compute, or a value transformers
    would refuse, is a ConfigError naming the file and its key."""
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
    fields |= {"rope_scaling_type": rope_type, "rope_scaling_factor": float(_require(scaling, "factor", where))}
    if rope_type == "llama3":
        fields |= {"rope_low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
                   "rope_high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
                   "rope_original_max_seq_len": int(scaling.get("original_max_position_embeddings", 8192))}
    elif rope_type == "yarn":
        if scaling.get("original_max_position_embeddings") is None:
            raise ConfigError(f"{where}: rope type 'yarn' needs 'original_max_position_embeddings' (the context "
                              "length the model was pre-trained with, e.g. 32768 for Qwen2.5/Qwen3)")
        if not isinstance(scaling.get("truncate", True), bool):
            raise ConfigError(f"{where}: 'truncate' is {json.dumps(scaling['truncate'])}; expected true or false")
        optional = {k: scaling[k] if scaling.get(k) is not None else v for k, v in _YARN_DEFAULTS.items()}
        fields |= {"rope_original_max_seq_len": int(scaling["original_max_position_embeddings"]),
                   "rope_beta_fast": float(optional["beta_fast"]), "rope_beta_slow": float(optional["beta_slow"]),
                   "rope_truncate": bool(optional["truncate"]),
                   **{f"rope_{k}": _float(optional, k) for k in ("attention_factor", "mscale", "mscale_all_dim")}}
    return fields


def _float(values: dict, key: str) -> float | None:
    return None if values[key] is None else float(values[key])


def _family_options(cfg: dict, model_type: str, source: str) -> dict:
    """The LlamaArgs options a family's config.json sets; a setting titan_lite cannot represent is a ConfigError
    naming its key."""
    if model_type == "llama":
        _expect(cfg, "attention_bias", (False,), source)
        _expect(cfg, "mlp_bias", (False,), source)
        return {}
    layer_types = cfg.get("layer_types") or []
    if model_type in WINDOW_FAMILIES:
        if len(set(layer_types)) > 1:
            raise ConfigError(f"{source}: 'layer_types' mixes {sorted(set(layer_types))}; titan_lite's "
                              f"{ARCHITECTURES[model_type]} attends the same way in every layer")
        window = cfg.get("sliding_window")
        moe = _mixtral_options(cfg, source) if model_type == "mixtral" else {}
        return {"sliding_window": int(window) if window is not None else None, **moe}
    # qwen2 / qwen3: a window applies only to the layers from max_window_layers on, when use_sliding_window is set.
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{source}: 'use_sliding_window' is true (sliding windows in the layers from "
                          f"max_window_layers = {cfg.get('max_window_layers')} on); titan_lite's {model_type} "
                          "supports only false")
    if any(kind != "full_attention" for kind in layer_types):
        raise ConfigError(f"{source}: 'layer_types' has {sorted(set(layer_types))}; titan_lite's {model_type} "
                          "supports only 'full_attention'")
    if model_type == "qwen3":
        _expect(cfg, "attention_bias", (False,), source)  # True would also give o_proj a bias
        return {"qk_norm": True}
    if model_type == "qwen3_moe":
        _expect(cfg, "attention_bias", (False,), source)
        return {"qk_norm": True, **_moe_options(cfg, source)}
    return {"qkv_bias": True}


def _mixtral_options(cfg: dict, source: str) -> dict:
    """The MoE LlamaArgs of a Mixtral config.json: every layer routed, top-k renormalised, experts of
    intermediate_size; router jitter (training noise on the router's input) is not supported."""
    _expect(cfg, "router_jitter_noise", (0, 0.0), source)
    n_experts = int(_require(cfg, "num_local_experts", source))
    top_k = int(_require(cfg, "num_experts_per_tok", source))
    if not 0 < top_k <= n_experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' is {top_k}; expected 1 to num_local_experts = "
                          f"{n_experts}")
    return {"n_experts": n_experts, "moe_top_k": top_k, "moe_ffn_dim": int(_require(cfg, "intermediate_size", source)),
            "moe_norm_topk_prob": True, "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001))}


def _moe_options(cfg: dict, source: str) -> dict:
    """The MoE LlamaArgs of a Qwen3-MoE config.json (transformers 5 writes num_experts as num_local_experts)."""
    n_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    if not n_experts:
        return {}
    top_k = int(_require(cfg, "num_experts_per_tok", source))
    if not 0 < top_k <= n_experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' is {top_k}; expected 1 to num_experts = {n_experts}")
    return {"n_experts": n_experts, "moe_top_k": top_k,
            "moe_ffn_dim": int(_require(cfg, "moe_intermediate_size", source)),
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
            "moe_dense_layers": sorted(int(i) for i in cfg.get("mlp_only_layers") or []) or None,
            "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001))}


def args_from_hf_config(cfg: dict, source: str = "config.json") -> LlamaArgs:
    """LlamaArgs of a config.json of one of the families (model_type llama, qwen2, qwen3, qwen3_moe, mistral,
    mixtral); anything the decoder cannot represent raises ConfigError naming the key."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"{source}: model_type is '{model_type}'; expected one of {', '.join(ARCHITECTURES)}")
    _expect(cfg, "hidden_act", ("silu",), source)
    dim, n_heads = int(_require(cfg, "hidden_size", source)), int(_require(cfg, "num_attention_heads", source))
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim {head_dim} is odd; rotary embeddings rotate pairs of channels")
    args = LlamaArgs(
        dim=dim, n_layers=int(_require(cfg, "num_hidden_layers", source)), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), vocab_size=int(_require(cfg, "vocab_size", source)),
        ffn_dim=int(_require(cfg, "intermediate_size", source)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_n_heads=cfg.get("layer_n_heads"), layer_n_kv_heads=cfg.get("layer_n_kv_heads"),
        layer_ffn_dims=cfg.get("layer_ffn_dims"), explicit_head_dim=None if head_dim == dim // n_heads else head_dim,
        family=model_type, **_family_options(cfg, model_type, source), **_rope_fields(cfg, source))
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


# The rope fields; those after the factor mean nothing without scaling.
ROPE_FIELDS = ("rope_theta", "rope_scaling_factor", "rope_scaling_type", "rope_low_freq_factor",
               "rope_high_freq_factor", "rope_original_max_seq_len", "rope_beta_fast", "rope_beta_slow",
               "rope_truncate", "rope_attention_factor", "rope_mscale", "rope_mscale_all_dim")
# Fields compared by check_args_against_hf_config; max_seq_len is left out (training picks its own length).
_CHECKED_FIELDS = ("family", "dim", "n_layers", "n_heads", "kv_heads", "head_dim", "vocab_size", "ffn_dim",
                   "norm_eps", *ROPE_FIELDS, "tie_word_embeddings", "layer_n_heads", "layer_n_kv_heads",
                   "layer_ffn_dims", "qkv_bias", "qk_norm", "sliding_window", "n_experts", "moe_top_k",
                   "moe_ffn_dim", "moe_norm_topk_prob", "moe_layers")
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
            label = "n_kv_heads" if name == "kv_heads" else name
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
