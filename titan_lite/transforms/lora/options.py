"""The [lora] section resolved: which projections get adapters, each one's rank, alpha and scale (rank_pattern,
alpha_pattern), which modules train in full, and the refusals a config can earn before launch."""

import re
from dataclasses import dataclass

from titan_lite.config.schema import JobConfig, Lora
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.names import LLAMA_NAMES
from titan_lite.transforms.lora.module import adapter_scale

# titan_lite projection -> (its parent in a block, the Hugging Face name)
PROJECTIONS = {
    "wq": ("attention", "q_proj"), "wk": ("attention", "k_proj"), "wv": ("attention", "v_proj"),
    "wo": ("attention", "o_proj"), "w1": ("feed_forward", "gate_proj"), "w3": ("feed_forward", "up_proj"),
    "w2": ("feed_forward", "down_proj"),
    # Qwen3.5's Gated DeltaNet (the linear_attention layers' mixer, held as layers.{i}.attention): HF linear_attn.*
    **{name: ("attention", name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")},
    # DeepSeek-V3's latent attention (its one-matrix query is wq): the query's and the latent's down- and up-projections
    **{name: ("attention", name) for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")},
}
LATENT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
SHARED_EXPERTS = "moe.shared_experts"  # DeepSeek-V3's: w1, w2, w3 of a routed layer (PEFT's gate_proj ... match them)
HF_PROJECTIONS = {hf: titan for titan, (_, hf) in PROJECTIONS.items()}
FEED_FORWARD = ("w1", "w2", "w3")
# An MoE layer's gated shared expert (Qwen3.5-MoE): its SwiGLU answers the feed-forward targets (HF
# mlp.shared_expert.gate_proj ...). Its gate, shared_expert_gate (dim -> 1), is never adapted: a rank-r update of a
# one-row weight is no low-rank update (more parameters than the row itself), and all-linear leaves it out as it
# leaves the router out.
SHARED_EXPERT = "moe.shared_expert"
ALL_LINEAR = "all-linear"
# An MoE layer's expert groups (transforms/lora/experts.py): a target_modules entry -> the groups it adapts, and each
# group's titan_lite module (layers.{i}.moe.experts.<group>) <-> the HF parameter PEFT targets.
EXPERT_TARGETS = {"experts": ("gate_up", "down"), "experts.gate_up_proj": ("gate_up",),
                  "mlp.experts.gate_up_proj": ("gate_up",), "gate_up_proj": ("gate_up",),
                  "experts.down_proj": ("down",), "mlp.experts.down_proj": ("down",)}
EXPERT_GROUPS = {"gate_up": "gate_up_proj", "down": "down_proj"}
_SPLIT_EXPERTS = ("experts.w1", "experts.w3", "experts.gate_proj", "experts.up_proj", "experts.w2")
# Modules train_modules may name besides projections: titan_lite name -> HF name.
FULL_MODULES = {"output": "lm_head", "tok_embeddings": "embed_tokens", "norm": "norm",
                "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "router": "gate", "experts": "experts"}  # an MoE layer's router (mlp.gate) and experts
HF_FULL_MODULES = {hf: titan for titan, hf in FULL_MODULES.items()}
TIED_MODULES = ("output", "tok_embeddings")
PISSA_NITER = re.compile(r"pissa_niter_(\d+)")
INITS = ("default", "gaussian", "pissa", "pissa_niter_N")


@dataclass(frozen=True)
class AdapterSpec:
    """One adapted projection's rank, alpha and scale."""

    rank: int
    alpha: float
    scale: float


def hf_module_name(module: str) -> str:
    """layers.0.attention.wq -> model.layers.0.self_attn.q_proj; output -> lm_head; an expert group
    layers.0.moe.experts.gate_up -> model.layers.0.mlp.experts.gate_up_proj (the fused parameter PEFT targets)."""
    group = expert_group_of(module)
    if group is not None:
        return f"model.layers.{module.split('.')[1]}.mlp.experts.{EXPERT_GROUPS[group]}"
    return LLAMA_NAMES.to_hf(f"{module}.weight").removesuffix(".weight")


def expert_group_of(module: str) -> str | None:
    """gate_up or down for an expert group's module name (layers.{i}.moe.experts.<group>), else None."""
    parent, _, group = module.rpartition(".")
    return group if parent.endswith(".moe.experts") and group in EXPERT_GROUPS else None


def pattern_matches(pattern: str, module: str) -> bool:
    """PEFT's rule: the regex matches the end of the module name, at a dot boundary; tried on the titan_lite and the
    Hugging Face name of the module."""
    regex = re.compile(rf"(.*\.)?({pattern})$")
    return any(regex.match(name) for name in (module, hf_module_name(module)))


def _parse_pattern(key: str, entry: str, cast: type) -> tuple[str, float]:
    pattern, sep, value = entry.rpartition("=")
    if not sep or not pattern:
        raise ConfigError(f"'lora.{key}' entry {entry!r} is not 'regex=value'")
    try:
        re.compile(pattern)
        number = cast(value)
    except re.error as exc:
        raise ConfigError(f"'lora.{key}' entry {entry!r}: invalid regex ({exc})") from None
    except ValueError:
        kind = "an integer" if cast is int else "a number"
        raise ConfigError(f"'lora.{key}' entry {entry!r}: '{value}' is not {kind}") from None
    if number <= 0:
        raise ConfigError(f"'lora.{key}' entry {entry!r}: the value must be positive")
    return pattern, number


def _short_name(key: str, name: str, hf_map: dict[str, str], known: tuple[str, ...]) -> str:
    if name in known:
        return name
    if name in hf_map:
        return hf_map[name]
    raise ConfigError(f"'lora.{key}' has unknown module '{name}'; expected one of: {', '.join(known + tuple(hf_map))}")


@dataclass
class LoraOptions:
    """The [lora] section checked and resolved (titan_lite short names: wq ... w3, output, norm ...)."""

    section: Lora
    targets: tuple[str, ...]
    train_modules: tuple[str, ...]
    rank_pattern: list[tuple[str, int]]
    alpha_pattern: list[tuple[str, float]]
    niter: int | None
    expert_groups: tuple[str, ...] = ()  # gate_up and/or down: the MoE layers' adapted expert projections

    @property
    def pissa(self) -> bool:
        return self.section.init.startswith("pissa")

    @classmethod
    def from_section(cls, c: Lora) -> "LoraOptions":
        """Every check that needs only the [lora] section; each failure is one ConfigError line naming the key."""
        if c.rank < 1:
            raise ConfigError(f"'lora.rank' must be at least 1, got {c.rank}")
        if c.alpha <= 0:
            raise ConfigError(f"'lora.alpha' must be positive, got {c.alpha}")
        if not 0 <= c.dropout < 1:
            raise ConfigError(f"'lora.dropout' must be in [0, 1), got {c.dropout}")
        niter = _niter(c.init)
        if not c.target_modules:
            raise ConfigError("'lora.target_modules' is empty; name the projections to adapt, or all-linear")
        targets, groups = [], []
        for name in c.target_modules:
            if name in _SPLIT_EXPERTS:
                raise ConfigError(f"'lora.target_modules' has '{name}': an expert's gate and up projections are "
                                  "adapted together (one A per expert, as PEFT adapts transformers' fused "
                                  "gate_up_proj); name 'experts.gate_up_proj', 'experts.down_proj' or 'experts'")
            if name in EXPERT_TARGETS or name == ALL_LINEAR:
                groups += [g for g in EXPERT_TARGETS["experts" if name == ALL_LINEAR else name] if g not in groups]
                if name != ALL_LINEAR:
                    continue
            chosen = list(PROJECTIONS) if name == ALL_LINEAR else [
                _short_name("target_modules", name, HF_PROJECTIONS, tuple(PROJECTIONS) + tuple(EXPERT_TARGETS))]
            targets += [t for t in chosen if t not in targets]
        full = tuple(PROJECTIONS) + tuple(FULL_MODULES)
        train = []
        for name in c.train_modules:
            short = _short_name("train_modules", name, {**HF_PROJECTIONS, **HF_FULL_MODULES}, full)
            if short in targets or (short == "experts" and groups):
                raise ConfigError(f"'lora.train_modules' has '{name}', which 'lora.target_modules' already adapts")
            train.append(short)
        if c.refactor_freq < 0:
            raise ConfigError(f"'lora.refactor_freq' must be at least 0, got {c.refactor_freq}")
        if c.max_spectral_norm is not None and (c.max_spectral_norm <= 0 or c.refactor_freq == 0):
            raise ConfigError(f"'lora.max_spectral_norm' = {c.max_spectral_norm} needs a positive value and "
                              "'lora.refactor_freq' > 0 (the cap is applied when re-factoring)")
        if c.adapter_path is not None and c.init.startswith("pissa"):
            raise ConfigError(f"'lora.adapter_path' starts the adapters from a file, but 'lora.init' = '{c.init}' "
                              "would compute them from the weights; use init = 'default'")
        return cls(c, tuple(targets), tuple(train),
                   [_parse_pattern("rank_pattern", e, int) for e in c.rank_pattern],
                   [_parse_pattern("alpha_pattern", e, float) for e in c.alpha_pattern], niter, tuple(groups))

    # ------------------------------------------------------------------------------ per module

    def spec(self, module: str) -> AdapterSpec:
        """Rank, alpha and scale of one adapted projection (e.g. layers.3.attention.wq): the first matching pattern
        entry, else the section's rank and alpha."""
        rank = next((r for p, r in self.rank_pattern if pattern_matches(p, module)), self.section.rank)
        alpha = next((a for p, a in self.alpha_pattern if pattern_matches(p, module)), self.section.alpha)
        return AdapterSpec(int(rank), float(alpha), adapter_scale(int(rank), float(alpha), self.section.use_rslora))

    def is_train_module(self, module: str) -> bool:
        """Whether a module (canonical name) trains in full: its last name is one of train_modules (the final norm
        is the top-level 'norm' only; an MoE layer's router is 'router', its linear layers.{i}.moe.router.gate)."""
        if module.endswith(".moe.router.gate"):
            return "router" in self.train_modules
        return module.rsplit(".", 1)[-1] in self.train_modules

    def targets_of(self, args: LlamaArgs, layer: int) -> tuple[str, ...]:
        """The adapted projections a layer has: a routed layer has no dense feed-forward, a Gated DeltaNet layer
        no attention projections and an attention layer no DeltaNet ones."""
        present = projection_dims(args, layer)
        return tuple(t for t in self.targets if t in present)

    def adapted_modules(self, args: LlamaArgs) -> dict[str, tuple[int, int]]:
        """Adapted linear module name -> (in_features, out_features), over every layer of the model."""
        out = {}
        for i in range(args.n_layers):
            dims = projection_dims(args, i)
            for short in self.targets_of(args, i):
                out[f"layers.{i}.{projection_parent(args, i, short)}.{short}"] = dims[short]
        return out

    def adapted_expert_groups(self, args: LlamaArgs) -> dict[str, tuple[int, int, int]]:
        """Adapted expert group module name (layers.{i}.moe.experts.gate_up) -> (experts, in, out)."""
        widths = {"gate_up": (args.dim, 2 * args.moe_ffn_dim), "down": (args.moe_ffn_dim, args.dim)}
        return {f"layers.{i}.moe.experts.{g}": (args.n_experts, *widths[g])
                for i in args.moe_layers for g in self.expert_groups}

    def match_report(self, args: LlamaArgs) -> list[str]:
        """What each target_modules entry matched: linear modules and expert parameters (one line each); a
        ConfigError for an entry that matches nothing in this model."""
        linear, groups = self.adapted_modules(args), self.adapted_expert_groups(args)
        lines = []
        for entry in self.section.target_modules:
            mine = entry_targets(entry)
            modules = [m for m in linear if m.rsplit(".", 1)[1] in mine]
            experts = [m for m in groups if m.rsplit(".", 1)[1] in mine]
            if not modules and not experts:
                raise ConfigError(f"'lora.target_modules' entry '{entry}' matches no module of this model"
                                  f"{_why_nothing(entry, args)}")
            numel = sum(linear[m][0] * linear[m][1] for m in modules)
            expert_numel = sum(e * fan_in * fan_out for e, fan_in, fan_out in (groups[m] for m in experts))
            lines.append(f"lora: target '{entry}' matched {len(modules)} linear modules ({numel:,} parameters) and "
                         f"{len(experts)} expert groups ({expert_numel:,} expert parameters)")
        return lines

    # ------------------------------------------------------------------------------ checks with the model

    def check_model(self, cfg: JobConfig, args: LlamaArgs) -> None:
        """Refusals that need the model or the rest of the job config."""
        modules = self.adapted_modules(args)
        for key, entries in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            for pattern, value in entries:
                if not any(pattern_matches(pattern, m) for m in modules):
                    raise ConfigError(f"'lora.{key}' entry '{pattern}={value:g}' matches no adapted module "
                                      f"(e.g. '{next(iter(modules))}' or '{hf_module_name(next(iter(modules)))}')")
        if self.pissa:
            for module, (fan_in, fan_out) in modules.items():
                rank = self.spec(module).rank
                if rank > min(fan_in, fan_out):
                    raise ConfigError(f"'lora.init' = '{self.section.init}' needs rank <= min(in, out) of every "
                                      f"adapted weight; {module} is {fan_out} x {fan_in} with rank {rank}")
        tied = [m for m in self.train_modules if m in TIED_MODULES]
        if args.tie_word_embeddings and tied:
            raise ConfigError(f"'lora.train_modules' has '{tied[0]}', but this model ties its embeddings to its output "
                              "head: a PEFT adapter cannot carry one trained copy of a tied weight")
        ac = cfg.activation_checkpoint
        if self.section.dropout > 0 and ac.mode != "none" and not ac.preserve_rng_state:
            raise ConfigError(f"'lora.dropout' = {self.section.dropout} with activation checkpointing needs "
                              "'activation_checkpoint.preserve_rng_state' = true (the recomputed forward must draw "
                              "the same dropout masks)")


def projection_parent(args: LlamaArgs, layer: int, short: str) -> str:
    """The module in a block holding projection `short`: a routed layer's w1/w2/w3 are its gated shared expert's
    (Qwen3.5-MoE) or its shared experts' (DeepSeek-V3)."""
    if short in FEED_FORWARD and args.is_moe_layer(layer):
        return SHARED_EXPERT if args.moe_shared_ffn_dim else SHARED_EXPERTS
    return PROJECTIONS[short][0]


def _latent_dims(args: LlamaArgs) -> dict[str, tuple[int, int]]:
    qk, heads = args.qk_nope_head_dim + args.qk_rope_head_dim, args.n_heads
    query = {"wq": (args.dim, heads * qk)} if args.q_lora_rank is None else {
        "q_a_proj": (args.dim, args.q_lora_rank), "q_b_proj": (args.q_lora_rank, heads * qk)}
    return {**query, "kv_a_proj_with_mqa": (args.dim, args.kv_lora_rank + args.qk_rope_head_dim),
            "kv_b_proj": (args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim)),
            "wo": (heads * args.v_head_dim, args.dim)}


def projection_dims(args: LlamaArgs, layer: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each block linear layer `layer` has: its mixer's (attention, latent
    attention or a Gated DeltaNet) and its dense feed-forward's, or a routed layer's shared expert(s)'."""
    if args.layer_type(layer) == "latent_attention":
        dims = _latent_dims(args)
    elif args.layer_type(layer) == "linear_attention":
        keys = args.linear_n_key_heads * args.linear_key_head_dim
        values = args.linear_n_value_heads * args.linear_value_head_dim
        heads = args.linear_n_value_heads
        dims = {"in_proj_qkv": (args.dim, 2 * keys + values), "in_proj_z": (args.dim, values),
                "in_proj_b": (args.dim, heads), "in_proj_a": (args.dim, heads), "out_proj": (values, args.dim)}
    else:
        heads, kv_heads = args.heads_of(layer)
        q, kv = heads * args.head_dim, kv_heads * args.head_dim
        gated_q = 2 * q if args.attn_output_gate else q  # Qwen3.5's wq holds each head's gate rows too
        dims = {"wq": (args.dim, gated_q), "wk": (args.dim, kv), "wv": (args.dim, kv), "wo": (q, args.dim)}
    shared = args.moe_shared_ffn_dim or args.moe_ffn_dim * args.moe_shared_experts
    ffn = shared if args.is_moe_layer(layer) else args.ffn_dim_of(layer)
    if ffn:
        dims.update({"w1": (args.dim, ffn), "w3": (args.dim, ffn), "w2": (ffn, args.dim)})
    return dims


def entry_targets(entry: str) -> tuple[str, ...]:
    """The projections (wq ... w2) and expert groups (gate_up, down) one target_modules entry names."""
    if entry == ALL_LINEAR:
        return tuple(PROJECTIONS) + EXPERT_TARGETS["experts"]
    if entry in EXPERT_TARGETS:
        return EXPERT_TARGETS[entry]
    return (HF_PROJECTIONS.get(entry, entry),)


def _why_nothing(entry: str, args: LlamaArgs) -> str:
    targets = entry_targets(entry)
    if set(targets) <= set(FEED_FORWARD) and args.n_experts and not set(range(args.n_layers)) - set(args.moe_layers):
        return ("; every layer's feed-forward is routed experts: adapt them with 'experts' (or 'experts.gate_up_proj', "
                "'experts.down_proj')")
    if set(targets) <= set(EXPERT_GROUPS):
        return "; it has no MoE layer"
    return ""


def _niter(init: str) -> int | None:
    if init in ("default", "gaussian", "pissa"):
        return None
    match = PISSA_NITER.fullmatch(init)
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(f"'lora.init' = {init!r} is not one of: {', '.join(INITS)} (N >= 1)")
    return int(match.group(1))
