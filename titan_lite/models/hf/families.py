"""The families titan_lite reads and writes, a row per Hugging Face model_type: the architecture, the options the
family fixes (q/k/v biases, q/k norms), whether it may route experts or slide a window, its own config.json keys in
each direction, and how its files spell the layer names apart from Qwen3-MoE's (models/hf/names.py)."""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.mxfp4 import quantization_method
from titan_lite.models.parts.group_router import check_groups

logger = logging.getLogger("titan_lite")


@dataclass(frozen=True)
class Fused:
    """One HF layer tensor holding several titan_lite ones (gpt-oss's experts: gate_up_proj interleaves w1 and w3):
    `parts` the titan_lite layer suffixes it holds, `split` the HF tensor -> those tensors, `join` back."""

    parts: tuple[str, ...]
    split: Callable[[Tensor], list[Tensor]]
    join: Callable[[list[Tensor]], Tensor]


@dataclass(frozen=True)
class Family:
    architecture: str
    read: Callable[[dict, str], dict]  # config.json -> the LlamaArgs options it sets (ConfigError naming a key)
    write: Callable[[LlamaArgs], dict]  # LlamaArgs -> the config.json keys of this family's own
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False  # may route experts
    window: bool = False  # may attend within a sliding window
    renames: dict[str, str] = field(default_factory=dict)  # HF layer suffixes spelled apart from Qwen3-MoE's
    check: Callable[[LlamaArgs, str], None] | None = None  # refuses args the family's class cannot hold
    fixed: dict = field(default_factory=dict)  # further LlamaArgs options the family always has (Qwen3.5's gate)
    hybrid: bool = False  # may mix mixers across layers (Qwen3.5: Gated DeltaNet and attention; Gemma 3: windows)
    model_type: str | None = None  # the model_type its config.json is written with, where not the row's key
    # where a multimodal folder holds the text model's "model." tensors (Qwen3.5: model.language_model.)
    text_prefix: str | None = None
    # HF tensor-name prefixes of parts titan_lite does not build, skipped on load (and said) -> what they are
    skipped: dict[str, str] = field(default_factory=dict)
    fused: dict[str, Fused] = field(default_factory=dict)  # HF layer suffix -> the titan_lite tensors it holds
    unfused_too: bool = False  # its folders may hold the fused experts one tensor per expert instead (read either)
    # titan_lite layer suffixes only this family has -> its HF suffixes (gpt-oss's sinks and biases, Gemma 3's
    # sandwich norms); the family's renames do not apply to them
    layer_names: dict[str, str] = field(default_factory=dict)
    # LlamaArgs options (default None) its config.json may set, which other families must leave unset
    options: tuple[str, ...] = ()
    hidden_act: str = "silu"  # the feed-forward's activation as config.json names it
    # transformers' defaults of the family's config class, for the keys a release's config.json leaves out
    config_defaults: dict = field(default_factory=dict)
    # keys the family's config class derives from others whatever config.json says (DeepSeek-V3: head_dim)
    derived: Callable[[dict], dict] | None = None


def require_key(cfg: dict, key: str, source: str):
    """cfg[key]; a ConfigError naming the file and the key when it is missing."""
    if key not in cfg:
        raise ConfigError(f"{source}: missing '{key}'")
    return cfg[key]


def expect_value(cfg: dict, key: str, allowed: tuple, source: str) -> None:
    """A ConfigError naming the key where cfg sets it to a value outside `allowed` (the first is the one named)."""
    if key in cfg and cfg[key] not in allowed:
        model_type = cfg.get("model_type", "llama")
        family = FAMILIES.get(MODEL_TYPE_ALIASES.get(model_type, model_type))
        model = family.architecture if family else "Llama"
        raise ConfigError(f"{source}: '{key}' is {cfg[key]!r}; titan_lite's {model} supports only {allowed[0]!r}")


# ------------------------------------------------------------------------------------- config.json -> args


def _llama_options(cfg: dict, source: str) -> dict:
    expect_value(cfg, "attention_bias", (False,), source)
    expect_value(cfg, "mlp_bias", (False,), source)
    return {}


def _uniform_window(cfg: dict, source: str) -> dict:
    """Mistral and Mixtral: one sliding window (or none) in every layer."""
    layer_types = cfg.get("layer_types") or []
    if len(set(layer_types)) > 1:
        raise ConfigError(f"{source}: 'layer_types' mixes {sorted(set(layer_types))}; titan_lite's "
                          f"{FAMILIES[cfg['model_type']].architecture} attends the same way in every layer")
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window is not None else None}


def _no_window(cfg: dict, source: str) -> dict:
    """Qwen2 and Qwen3: a window applies only to the layers from max_window_layers on, when use_sliding_window is
    set; titan_lite reads only configs without one."""
    model_type = cfg["model_type"]
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{source}: 'use_sliding_window' is true (sliding windows in the layers from "
                          f"max_window_layers = {cfg.get('max_window_layers')} on); titan_lite's {model_type} "
                          "supports only false")
    layer_types = cfg.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ConfigError(f"{source}: 'layer_types' has {sorted(set(layer_types))}; titan_lite's {model_type} "
                          "supports only 'full_attention'")
    return {}


def _qwen3_options(cfg: dict, source: str) -> dict:
    options = _no_window(cfg, source)
    expect_value(cfg, "attention_bias", (False,), source)  # True would also give o_proj a bias
    return options


def _qwen3_moe_options(cfg: dict, source: str) -> dict:
    """Qwen3-MoE's experts (transformers 5 writes num_experts as num_local_experts); none: a dense Qwen3."""
    options = _no_window(cfg, source)
    expect_value(cfg, "attention_bias", (False,), source)
    n_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    if not n_experts:
        return options
    top_k = int(require_key(cfg, "num_experts_per_tok", source))
    if not 0 < top_k <= n_experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' is {top_k}; expected 1 to num_experts = {n_experts}")
    return {**options, "n_experts": n_experts, "moe_top_k": top_k,
            "moe_ffn_dim": int(require_key(cfg, "moe_intermediate_size", source)),
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
            "moe_dense_layers": sorted(int(i) for i in cfg.get("mlp_only_layers") or []) or None,
            "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001))}


def _mixtral_options(cfg: dict, source: str) -> dict:
    """Mixtral: every layer routed, top-k renormalised, experts of intermediate_size; router jitter (training noise
    on the router's input) is not supported."""
    window = _uniform_window(cfg, source)
    expect_value(cfg, "router_jitter_noise", (0, 0.0), source)
    n_experts = int(require_key(cfg, "num_local_experts", source))
    top_k = int(require_key(cfg, "num_experts_per_tok", source))
    if not 0 < top_k <= n_experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' is {top_k}; expected 1 to num_local_experts = "
                          f"{n_experts}")
    return {**window, "n_experts": n_experts, "moe_top_k": top_k,
            "moe_ffn_dim": int(require_key(cfg, "intermediate_size", source)), "moe_norm_topk_prob": True,
            "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001))}


def text_config_of(cfg: dict) -> dict:
    """A multimodal config.json's text part (Qwen3.5's `text_config`, tie_word_embeddings from the top when the text
    part lacks it, the text model_type where it lacks one), or the config itself."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    model_type = _TEXT_MODEL_TYPES.get(cfg.get("model_type"))  # where the text part does not say its own
    return {**({"model_type": model_type} if model_type else {}),
            **({"tie_word_embeddings": cfg["tie_word_embeddings"]} if "tie_word_embeddings" in cfg else {}), **text}


# a multimodal model_type -> its text model's
_TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma3": "gemma3_text"}


def _qwen3_5_schedule(cfg: dict, source: str) -> list[str]:
    """Qwen3.5's layer_types, given or from full_attention_interval (layer i is attention when (i + 1) % interval
    is 0; default 4)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    interval = cfg.get("full_attention_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"{source}: 'full_attention_interval' is {interval!r}; expected a positive integer")
    n_layers = int(require_key(cfg, "num_hidden_layers", source))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]


# The Gated DeltaNet's LlamaArgs fields -> (config.json key, transformers' default)
_LINEAR_KEYS = {"linear_n_key_heads": ("linear_num_key_heads", 16),
                "linear_n_value_heads": ("linear_num_value_heads", 32),
                "linear_key_head_dim": ("linear_key_head_dim", 128),
                "linear_value_head_dim": ("linear_value_head_dim", 128),
                "linear_conv_kernel": ("linear_conv_kernel_dim", 4)}


def _qwen3_5_mixers(cfg: dict, source: str) -> dict:
    """Qwen3.5's mixers, dense or MoE: Gated DeltaNet layers and gated attention by layer_types; partial RoPE (0.25
    unless said)."""
    expect_value(cfg, "attention_bias", (False,), source)
    expect_value(cfg, "attn_output_gate", (True,), source)  # transformers always builds the gate
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ConfigError(f"{source}: 'partial_rotary_factor' is {partial!r}; expected a number in (0, 1]")
    layer_types = _qwen3_5_schedule(cfg, source)
    options = {"layer_types": layer_types, "rope_partial_factor": float(partial)}
    if "linear_attention" not in layer_types:
        return options
    return {**options, **{name: int(cfg.get(key, default)) for name, (key, default) in _LINEAR_KEYS.items()}}


def _qwen3_5_options(cfg: dict, source: str) -> dict:
    """Qwen3.5 dense (Qwen3_5TextConfig has no experts: a config naming some is a Qwen3.5-MoE one mislabelled)."""
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key):
            raise ConfigError(f"{source}: '{key}' is {cfg[key]} in a dense Qwen3.5 config (model_type "
                              f"{cfg.get('model_type')!r}); a Qwen3.5-MoE config says model_type 'qwen3_5_moe_text' "
                              "(or 'qwen3_5_moe' with a text_config)")
    return _qwen3_5_mixers(cfg, source)


def _qwen3_5_moe_options(cfg: dict, source: str) -> dict:
    """Qwen3.5-MoE: the dense model's mixers, every layer routed (softmax top-k, always renormalised) beside a
    sigmoid-gated shared expert."""
    options = _qwen3_5_mixers(cfg, source)
    expect_value(cfg, "norm_topk_prob", (True,), source)  # transformers always renormalises the top k
    expect_value(cfg, "decoder_sparse_step", (1,), source)  # and routes every layer
    expect_value(cfg, "mlp_only_layers", ([], None), source)
    n_experts = int(require_key(cfg, "num_experts", source))
    top_k = int(require_key(cfg, "num_experts_per_tok", source))
    if not 0 < top_k <= n_experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' is {top_k}; expected 1 to num_experts = {n_experts}")
    shared = int(require_key(cfg, "shared_expert_intermediate_size", source))
    if shared < 1:
        raise ConfigError(f"{source}: 'shared_expert_intermediate_size' is {shared}; expected a positive width "
                          "(every Qwen3.5-MoE layer has a shared expert)")
    return {**options, "n_experts": n_experts, "moe_top_k": top_k,
            "moe_ffn_dim": int(require_key(cfg, "moe_intermediate_size", source)), "moe_norm_topk_prob": True,
            "moe_shared_ffn_dim": shared, "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001))}


def _qwen3_5_check(args: LlamaArgs, source: str) -> None:
    """Qwen3_5ForCausalLM: each layer a Gated DeltaNet or a full attention, every attention with q/k norms."""
    for layer, kind in enumerate(args.schedule):
        if kind not in ("linear_attention", "full_attention"):
            raise ConfigError(f"{source}: layer_types[{layer}] is {kind!r}, which a Qwen3_5ForCausalLM cannot write: "
                              "it has 'linear_attention' and 'full_attention' layers only")


def _qwen3_5_moe_check(args: LlamaArgs, source: str) -> None:
    """Qwen3_5MoeForCausalLM: Qwen3.5's mixers, every layer MoE with renormalised top-k weights and a shared expert."""
    _qwen3_5_check(args, source)
    differs = {"MoE layers": (args.moe_layers, list(range(args.n_layers))),
               "moe_norm_topk_prob": (args.moe_norm_topk_prob, True)}
    for option, (ours, qwen3_5_moe) in differs.items():
        if ours != qwen3_5_moe:
            raise ConfigError(f"{source}: {option} = {ours} cannot be written as a Qwen3_5MoeForCausalLM, which has "
                              f"{qwen3_5_moe}")
    if not args.moe_shared_ffn_dim:
        raise ConfigError(f"{source}: a Qwen3_5MoeForCausalLM has a shared expert in every layer; set "
                          "moe_shared_ffn_dim")


def _gpt_oss_options(cfg: dict, source: str) -> dict:
    """gpt-oss: every layer routed (experts of intermediate_size, the clamped SwiGLU's alpha and limit), sliding and
    full attention by layer_types (alternating from a sliding layer 0 unless said), all four attention biases. A
    `quantization_config` must be the release's MXFP4 (its experts' *_blocks / *_scales are dequantized on load)."""
    method = quantization_method(cfg)
    if method is not None and method != "mxfp4":
        raise ConfigError(f"{source}: 'quantization_config' is {method!r}; titan_lite's GptOssForCausalLM reads "
                          "only 'mxfp4' (the release's experts) or unquantized weights")
    expect_value(cfg, "attention_bias", (True,), source)
    n_experts = int(require_key(cfg, "num_local_experts", source))
    top_k = int(require_key(cfg, "num_experts_per_tok", source))
    if not 0 < top_k <= n_experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok' is {top_k}; expected 1 to num_local_experts = "
                          f"{n_experts}")
    n_layers = int(require_key(cfg, "num_hidden_layers", source))
    layer_types = list(cfg.get("layer_types") or
                       ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)])
    window = cfg.get("sliding_window")
    swiglu = {}
    for name, key, default in (("swiglu_alpha", "swiglu_alpha", 1.702), ("swiglu_limit", "swiglu_limit", 7.0)):
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{source}: '{key}' is {value!r}; expected a positive number")
        swiglu[name] = float(value)
    return {"layer_types": layer_types, "sliding_window": int(window) if window is not None else None,
            "n_experts": n_experts, "moe_top_k": top_k,
            "moe_ffn_dim": int(require_key(cfg, "intermediate_size", source)),
            "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001)), **swiglu}


def _gpt_oss_check(args: LlamaArgs, source: str) -> None:
    """GptOssForCausalLM: every layer MoE of one width, sliding or full attention, whole-head RoPE."""
    for layer, kind in enumerate(args.schedule):
        if kind not in ("sliding_attention", "full_attention"):
            raise ConfigError(f"{source}: layer_types[{layer}] is {kind!r}, which a GptOssForCausalLM cannot write: "
                              "it has 'sliding_attention' and 'full_attention' layers only")
    differs = {"MoE layers": (args.moe_layers, list(range(args.n_layers))),
               "moe_ffn_dim": (args.moe_ffn_dim, args.ffn_dim), "rope_partial_factor": (args.rope_partial_factor, 1.0)}
    for option, (ours, gpt_oss) in differs.items():
        if ours != gpt_oss:
            raise ConfigError(f"{source}: {option} = {ours} cannot be written as a GptOssForCausalLM, which has "
                              f"{gpt_oss}")


def _gemma3_schedule(cfg: dict, source: str) -> list[str]:
    """Gemma 3's layer_types, given or from sliding_window_pattern (layer i is full attention when (i + 1) % pattern
    is 0; default 6: five sliding layers to one full)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"{source}: 'sliding_window_pattern' is {pattern!r}; expected a positive integer")
    n_layers = int(require_key(cfg, "num_hidden_layers", source))
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]


def _gemma3_local_theta(cfg: dict, source: str) -> float:
    """The sliding layers' rope base: rope_parameters' "sliding_attention" entry (transformers 5), else
    rope_local_base_freq (default 10000); it must be plain RoPE."""
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, dict):
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.sliding_attention's rope_type is {local['rope_type']!r}; "
                              "titan_lite's Gemma3ForCausalLM supports only 'default' for the sliding layers")
        return float(local.get("rope_theta", 10000.0))
    return float(cfg.get("rope_local_base_freq", 10000.0))


def _gemma3_options(cfg: dict, source: str) -> dict:
    """Gemma 3 (text): sliding and full layers by layer_types, a rope per layer type, query_pre_attn_scalar; a
    multimodal folder's config without a text_config, softcapping or bidirectional attention refused in one line."""
    if cfg.get("model_type") == "gemma3":
        raise ConfigError(f"{source}: model_type 'gemma3' (Gemma 3 with a vision tower) has no 'text_config'; "
                          "titan_lite reads the text model from a 'text_config' object or a 'gemma3_text' config")
    expect_value(cfg, "hidden_activation", ("gelu_pytorch_tanh",), source)
    expect_value(cfg, "attention_bias", (False,), source)
    expect_value(cfg, "use_bidirectional_attention", (False, None), source)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(f"{source}: '{key}' is {cfg[key]!r}; titan_lite's Gemma3ForCausalLM supports only "
                              "null (no softcapping)")
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise ConfigError(f"{source}: 'query_pre_attn_scalar' is {scalar!r}; expected a positive number")
    layer_types = _gemma3_schedule(cfg, source)
    for layer, kind in enumerate(layer_types):
        if kind not in ("sliding_attention", "full_attention"):
            raise ConfigError(f"{source}: layer_types[{layer}] is {kind!r}; titan_lite's Gemma3ForCausalLM has "
                              "'sliding_attention' and 'full_attention' layers only")
    window = cfg.get("sliding_window", 4096) if "sliding_attention" in layer_types else cfg.get("sliding_window")
    return {"layer_types": layer_types, "sliding_window": None if window is None else int(window),
            "query_pre_attn_scalar": float(scalar), "rope_local_theta": _gemma3_local_theta(cfg, source)}


def _gemma3_check(args: LlamaArgs, source: str) -> None:
    """Gemma3ForCausalLM: sliding and full attention layers, a local rope base."""
    for layer, kind in enumerate(args.schedule):
        if kind not in ("sliding_attention", "full_attention"):
            raise ConfigError(f"{source}: layer_types[{layer}] is {kind!r}, which a Gemma3ForCausalLM cannot write: "
                              "it has 'sliding_attention' and 'full_attention' layers only")
    if args.rope_local_theta is None or args.query_pre_attn_scalar is None:
        raise ConfigError(f"{source}: a Gemma3ForCausalLM needs rope_local_theta and query_pre_attn_scalar set")


def _deepseek_v3_options(cfg: dict, source: str) -> dict:
    """DeepSeek-V3 (Kimi K2, Moonlight): latent attention in every layer (rope_interleave's weights), the first
    first_k_dense_replace layers dense, the others routed (sigmoid scores with the correction bias, group-limited
    top-k, shared experts); the optional sequence-wise aux loss from aux_loss_alpha where seq_aux; the multi-token
    prediction layers beyond num_hidden_layers skipped on load; either rope layout (rope_interleave). FP8 weights and
    attention biases are refused in one line."""
    if cfg.get("model_type") == "kimi_k2":
        logger.info(f"{source}: model_type 'kimi_k2' read as DeepSeek-V3 (deepseek_v3), whose config keys it has")
    quantization = cfg.get("quantization_config") or {}
    if quantization:
        raise ConfigError(f"{source}: 'quantization_config' is {quantization.get('quant_method', quantization)!r}: "
                          "DeepSeek-V3's FP8 block weights are not supported yet; give a bf16 checkpoint")
    expect_value(cfg, "attention_bias", (False,), source)
    interleave = cfg.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ConfigError(f"{source}: 'rope_interleave' is {interleave!r}; expected true or false")
    expect_value(cfg, "scoring_func", ("sigmoid",), source)
    expect_value(cfg, "topk_method", ("noaux_tc",), source)
    heads = int(require_key(cfg, "num_attention_heads", source))
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise ConfigError(f"{source}: 'num_key_value_heads' is {cfg['num_key_value_heads']}; DeepSeek-V3's latent "
                          f"attention expands keys and values for every head (num_attention_heads = {heads})")
    n_layers = int(require_key(cfg, "num_hidden_layers", source))
    n_experts = int(require_key(cfg, "n_routed_experts", source))
    top_k = int(require_key(cfg, "num_experts_per_tok", source))
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    check_groups(n_experts, top_k, n_group, topk_group, source)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    q_lora = cfg.get("q_lora_rank")
    aux = float(cfg.get("aux_loss_alpha", 0.0)) if cfg.get("seq_aux") else 0.0
    return {"layer_types": ["latent_attention"] * n_layers, "q_lora_rank": None if q_lora is None else int(q_lora),
            **{key: int(require_key(cfg, key, source))
               for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
            "n_mtp_layers": int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0),
            "n_experts": n_experts, "moe_top_k": top_k, "moe_ffn_dim": int(require_key(cfg, "moe_intermediate_size",
                                                                                         source)),
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
            "moe_dense_layers": list(range(first_dense)) or None, "moe_n_group": n_group, "moe_topk_group": topk_group,
            "moe_routed_scaling": float(cfg.get("routed_scaling_factor", 1.0)),
            "moe_shared_experts": int(cfg.get("n_shared_experts") or 0), "router_aux_loss_coef": aux,
            "moe_load_balance_coeff": DEEPSEEK_LOAD_BALANCE_COEFF, "rope_interleave": interleave}


def _deepseek_v3_check(args: LlamaArgs, source: str) -> None:
    """DeepseekV3ForCausalLM: latent attention in every layer, dense layers first then routed ones."""
    if set(args.schedule) != {"latent_attention"}:
        raise ConfigError(f"{source}: layer_types {sorted(set(args.schedule))} cannot be written as a "
                          "DeepseekV3ForCausalLM, which has latent attention in every layer")
    first_moe = args.moe_layers[0] if args.moe_layers else args.n_layers
    if args.moe_layers != list(range(first_moe, args.n_layers)):
        raise ConfigError(f"{source}: MoE layers {args.moe_layers} cannot be written as a DeepseekV3ForCausalLM, "
                          "whose routed layers are all those from first_k_dense_replace on")


# ------------------------------------------------------------------------------------- args -> config.json


def _no_window_keys(args: LlamaArgs) -> dict:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}


def _qwen3_moe_keys(args: LlamaArgs) -> dict:
    return {"attention_bias": False, **_no_window_keys(args),
            "num_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
            "moe_intermediate_size": args.moe_ffn_dim, "norm_topk_prob": args.moe_norm_topk_prob,
            "decoder_sparse_step": args.moe_sparse_step, "mlp_only_layers": list(args.moe_dense_layers or []),
            "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": False}


def _mixtral_keys(args: LlamaArgs) -> dict:
    """Mixtral: every layer MoE, intermediate_size the experts' width."""
    return {"sliding_window": args.sliding_window, "intermediate_size": args.moe_ffn_dim,
            "num_local_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
            "router_aux_loss_coef": args.router_aux_loss_coef, "router_jitter_noise": 0.0,
            "output_router_logits": False}


def _mixtral_check(args: LlamaArgs, source: str) -> None:
    """MixtralForCausalLM: every layer MoE of one width, the top-k weights always renormalised."""
    differs = {"moe_norm_topk_prob": (args.moe_norm_topk_prob, True),
               "MoE layers": (args.moe_layers, list(range(args.n_layers))),
               "moe_ffn_dim": (args.moe_ffn_dim, args.ffn_dim)}
    for option, (ours, mixtral) in differs.items():
        if ours != mixtral:
            raise ConfigError(f"{source}: {option} = {ours} cannot be written as a MixtralForCausalLM, which has "
                              f"{mixtral}")


def _qwen3_5_keys(args: LlamaArgs) -> dict:
    keys = {"attention_bias": False, "attn_output_gate": True, "layer_types": list(args.schedule)}
    if not args.is_hybrid:
        return keys
    linear = {key: getattr(args, name) for name, (key, _) in _LINEAR_KEYS.items()}
    return {**keys, **linear, "mamba_ssm_dtype": "float32"}


def _qwen3_5_moe_keys(args: LlamaArgs) -> dict:
    return {**_qwen3_5_keys(args), "num_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
            "moe_intermediate_size": args.moe_ffn_dim, "shared_expert_intermediate_size": args.moe_shared_ffn_dim,
            "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": False}


def _gpt_oss_keys(args: LlamaArgs) -> dict:
    return {"attention_bias": True, "sliding_window": args.sliding_window, "layer_types": list(args.schedule),
            "intermediate_size": args.moe_ffn_dim, "num_local_experts": args.n_experts,
            "num_experts_per_tok": args.moe_top_k, "swiglu_alpha": args.swiglu_alpha,
            "swiglu_limit": args.swiglu_limit, "router_aux_loss_coef": args.router_aux_loss_coef,
            "output_router_logits": False}


def _interleave(tensors: list[Tensor]) -> Tensor:
    """[..., n] tensors -> [..., 2n] with the first's columns at the even places, the second's at the odd."""
    return torch.stack(tensors, dim=-1).flatten(-2)


# gpt-oss's experts: gate_up_proj [E, dim, 2 hidden] (x @ W, gate and up columns interleaved), down_proj
# [E, hidden, dim], their biases; titan_lite's w1/w3 [E, hidden, dim], w2 [E, dim, hidden], b1/b3, b2.
_GPT_OSS_FUSED = {
    "mlp.experts.gate_up_proj": Fused(("moe.experts.w1", "moe.experts.w3"),
                                      lambda t: [t[..., ::2].transpose(1, 2), t[..., 1::2].transpose(1, 2)],
                                      lambda ts: _interleave([t.transpose(1, 2) for t in ts])),
    "mlp.experts.gate_up_proj_bias": Fused(("moe.experts.b1", "moe.experts.b3"),
                                           lambda t: [t[..., ::2], t[..., 1::2]], _interleave),
    "mlp.experts.down_proj": Fused(("moe.experts.w2",), lambda t: [t.transpose(1, 2)],
                                   lambda ts: ts[0].transpose(1, 2)),
    "mlp.experts.down_proj_bias": Fused(("moe.experts.b2",), lambda t: [t], lambda ts: ts[0]),
}
_GPT_OSS_NAMES = {"mlp.gate.weight": "mlp.router.weight"}
_GPT_OSS_LAYER_NAMES = {"moe.router.gate.bias": "mlp.router.bias", "attention.wo.bias": "self_attn.o_proj.bias",
                        "attention.sinks": "self_attn.sinks"}


def _deepseek_v3_keys(args: LlamaArgs) -> dict:
    first_moe = args.moe_layers[0] if args.moe_layers else args.n_layers
    return {"attention_bias": False, "rope_interleave": args.rope_interleave, "q_lora_rank": args.q_lora_rank,
            "kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim,
            "n_routed_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
            "moe_intermediate_size": args.moe_ffn_dim, "n_shared_experts": args.moe_shared_experts,
            "routed_scaling_factor": args.moe_routed_scaling, "n_group": args.moe_n_group,
            "topk_group": args.moe_topk_group, "norm_topk_prob": args.moe_norm_topk_prob,
            "first_k_dense_replace": first_moe, "num_nextn_predict_layers": 0, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "seq_aux": args.router_aux_loss_coef > 0,
            "aux_loss_alpha": args.router_aux_loss_coef, "output_router_logits": False}


# DeepSeek-V3's names apart from every family's (its latent attention and shared experts are in names.py, where the
# adapters' PEFT names find them too): the correction bias
_DEEPSEEK_V3_NAMES = {
    "moe.router.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
}
# torchtitan's MoEArgs.load_balance_coeff: the aux-loss-free bias moves by this each step (transformers: never)
DEEPSEEK_LOAD_BALANCE_COEFF = 1e-3
# DeepseekV3Config's defaults (transformers 5.24) for the keys a config.json leaves out
_DEEPSEEK_V3_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                         "v_head_dim": 128, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
                         "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "norm_topk_prob": True,
                         "rms_norm_eps": 1e-6}


# Qwen3.5-MoE's experts as its releases store them: gate_up_proj [E, 2 hidden, dim] (the gate's rows, then up's) and
# down_proj [E, dim, hidden], titan_lite's w1/w3 and w2 as they are; transformers' save_pretrained writes them one
# tensor per expert instead (Qwen3-MoE's names), which is read too.
_QWEN3_5_MOE_FUSED = {
    "mlp.experts.gate_up_proj": Fused(("moe.experts.w1", "moe.experts.w3"), lambda t: list(t.chunk(2, dim=1)),
                                      lambda ts: torch.cat(ts, dim=1)),
    "mlp.experts.down_proj": Fused(("moe.experts.w2",), lambda t: [t], lambda ts: ts[0]),
}
# Qwen3_5MoeTextConfig's defaults (transformers 5.24) for the MoE keys; it has no dense width (intermediate_size)
_QWEN3_5_MOE_DEFAULTS = {"intermediate_size": 0, "num_experts": 256, "num_experts_per_tok": 8,
                         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                         "router_aux_loss_coef": 0.001}


def _gemma3_keys(args: LlamaArgs) -> dict:
    scalar = args.query_pre_attn_scalar  # transformers' config takes an int only
    return {"attention_bias": False, "layer_types": list(args.schedule), "sliding_window": args.sliding_window,
            "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
            "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "use_bidirectional_attention": False}


# Gemma 3's sandwich norms: ffn_norm is its pre_feedforward_layernorm, post_attention_layernorm the mixer's output's.
_GEMMA3_RENAMES = {"post_attention_layernorm.weight": "pre_feedforward_layernorm.weight"}
_GEMMA3_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                 "post_ffn_norm.weight": "post_feedforward_layernorm.weight"}

# Gemma3TextConfig's defaults (transformers 5.24): the release folders' text_config leaves most of them out
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 131072, "tie_word_embeddings": True, "rope_theta": 1000000.0,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096}

# Mixtral's layer suffixes for Qwen3-MoE's (names.py's table).
_MIXTRAL_NAMES = {"mlp.gate.weight": "block_sparse_moe.gate.weight",
                  "mlp.experts.{j}.gate_proj.weight": "block_sparse_moe.experts.{j}.w1.weight",
                  "mlp.experts.{j}.up_proj.weight": "block_sparse_moe.experts.{j}.w3.weight",
                  "mlp.experts.{j}.down_proj.weight": "block_sparse_moe.experts.{j}.w2.weight"}

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", _llama_options,
                    lambda args: {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}),
    "qwen2": Family("Qwen2ForCausalLM", _no_window, _no_window_keys, qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", _qwen3_options, lambda args: {"attention_bias": False,
                                                                     **_no_window_keys(args)}, qk_norm=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", _qwen3_moe_options, _qwen3_moe_keys, qk_norm=True, moe=True),
    "mistral": Family("MistralForCausalLM", _uniform_window, lambda args: {"sliding_window": args.sliding_window},
                      window=True),
    "mixtral": Family("MixtralForCausalLM", _mixtral_options, _mixtral_keys, moe=True, window=True,
                      renames=_MIXTRAL_NAMES, check=_mixtral_check),
    # Qwen3.5's text model: written as Qwen3_5ForCausalLM ("qwen3_5_text"); read from either model_type, the
    # multimodal folder's text_config included
    "qwen3_5": Family("Qwen3_5ForCausalLM", _qwen3_5_options, _qwen3_5_keys, qk_norm=True, check=_qwen3_5_check,
                      fixed={"attn_output_gate": True, "norm_unit_offset": True}, hybrid=True,
                      model_type="qwen3_5_text", text_prefix="model.language_model.",
                      skipped={"model.visual.": "vision encoder", "mtp.": "multi-token prediction head"}),
    # Qwen3.5-MoE's text model (Qwen3_5MoeForCausalLM, "qwen3_5_moe_text"): the dense row's mixers, routed experts
    # (fused as the releases store them) and the gated shared expert in every layer
    "qwen3_5_moe": Family("Qwen3_5MoeForCausalLM", _qwen3_5_moe_options, _qwen3_5_moe_keys, qk_norm=True, moe=True,
                          check=_qwen3_5_moe_check, fixed={"attn_output_gate": True, "norm_unit_offset": True},
                          hybrid=True, model_type="qwen3_5_moe_text", text_prefix="model.language_model.",
                          skipped={"model.visual.": "vision encoder", "mtp.": "multi-token prediction head"},
                          fused=_QWEN3_5_MOE_FUSED, unfused_too=True,
                          options=("moe_shared_ffn_dim",), config_defaults=_QWEN3_5_MOE_DEFAULTS),
    # gpt-oss (bf16, or the release's MXFP4 experts dequantized on load): sinks, biased router, clamped SwiGLU
    # experts with biases, sliding/full layers
    "gpt_oss": Family("GptOssForCausalLM", _gpt_oss_options, _gpt_oss_keys, qkv_bias=True, moe=True, window=True,
                      renames=_GPT_OSS_NAMES, check=_gpt_oss_check, hybrid=True, fused=_GPT_OSS_FUSED,
                      layer_names=_GPT_OSS_LAYER_NAMES,
                      fixed={"attn_sinks": True, "attn_out_bias": True, "moe_router": "topk_softmax",
                             "moe_router_bias": True, "expert_act": "clamped_swiglu", "expert_bias": True}),
    # Gemma 3's text model (Gemma3ForCausalLM, "gemma3_text"); a "gemma3" folder's text_config read, its vision
    # tower and projector skipped
    "gemma3_text": Family("Gemma3ForCausalLM", _gemma3_options, _gemma3_keys, qk_norm=True, window=True,
                          check=_gemma3_check, hybrid=True, renames=_GEMMA3_RENAMES, layer_names=_GEMMA3_NAMES,
                          fixed={"norm_unit_offset": True, "sandwich_norms": True, "embed_scale": True,
                                 "ffn_activation": "gelu_tanh"},
                          options=("query_pre_attn_scalar", "rope_local_theta"), hidden_act="gelu_pytorch_tanh",
                          config_defaults=_GEMMA3_DEFAULTS,
                          text_prefix="model.language_model.",
                          skipped={"model.vision_tower.": "vision tower",
                                   "model.multi_modal_projector.": "multimodal projector"}),
    # DeepSeek-V3 (Kimi K2 and Moonlight folders alike): latent attention, dense then routed layers with DeepSeek's
    # router and shared experts; the multi-token prediction layers (beyond num_hidden_layers) skipped on load
    "deepseek_v3": Family("DeepseekV3ForCausalLM", _deepseek_v3_options, _deepseek_v3_keys, moe=True,
                          check=_deepseek_v3_check, layer_names=_DEEPSEEK_V3_NAMES,
                          fixed={"moe_router": "sigmoid_group"},
                          config_defaults=_DEEPSEEK_V3_DEFAULTS,
                          derived=lambda cfg: {"head_dim": cfg.get("qk_rope_head_dim")}),
}
# model_type values read as another row's
MODEL_TYPE_ALIASES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "gemma3": "gemma3_text",
                      "kimi_k2": "deepseek_v3"}
# The options a family fixes, at the values every other family has
FIXED_DEFAULTS = {"attn_output_gate": False, "norm_unit_offset": False, "sandwich_norms": False,
                  "embed_scale": False, "ffn_activation": "silu", "attn_sinks": False, "attn_out_bias": False,
                  "moe_router_bias": False, "expert_bias": False, "moe_router": "softmax_topk",
                  "expert_act": "swiglu"}
ARCHITECTURES = {model_type: family.architecture for model_type, family in FAMILIES.items()}
MOE_FAMILIES = tuple(model_type for model_type, family in FAMILIES.items() if family.moe)
WINDOW_FAMILIES = tuple(model_type for model_type, family in FAMILIES.items() if family.window)
