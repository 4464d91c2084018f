"""titan_lite <-> Hugging Face state-dict names of the decoder: the layer and top-level names, one HF tensor per
expert for the grouped expert weights, each family's spelling (the renames of its row in families.py), and the
names a transform adds."""

import re
from dataclasses import dataclass, field, replace

from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.families import FAMILIES, Fused

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
    "moe.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",  # Qwen3.5-MoE's gated shared expert
    "moe.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
    # Qwen3.5's Gated DeltaNet (the linear_attention layers): transformers' names under the mixer's
    **{f"attention.{name}": f"linear_attn.{name}"
       for name in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                    "out_proj.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight")},
    # DeepSeek-V3's latent attention (its one-matrix query is wq, q_proj) and shared experts
    **{f"attention.{name}": f"self_attn.{name}"
       for name in ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                    "kv_a_layernorm.weight", "kv_b_proj.weight")},
    **{f"moe.shared_experts.{titan}.weight": f"mlp.shared_experts.{hf}.weight"
       for titan, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
}
# Grouped expert weights [E, ...] (titan_lite suffix) -> the HF suffix of expert j's own tensor, {j} its index.
_EXPERT_NAMES = {
    "moe.experts.w1": "mlp.experts.{j}.gate_proj.weight",
    "moe.experts.w3": "mlp.experts.{j}.up_proj.weight",
    "moe.experts.w2": "mlp.experts.{j}.down_proj.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TITAN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass
class HFNames:
    """titan_lite <-> HF names of a Llama's parameters. A transform extends the run's copy (`Transform.hf_names`)
    with layer-level names it adds, and with patterns of names that no HF folder holds (adapters, masks)."""

    layer: dict[str, str] = field(default_factory=lambda: dict(_LAYER_NAMES))
    top: dict[str, str] = field(default_factory=lambda: dict(_TOP_NAMES))
    not_in_hf: list[re.Pattern] = field(default_factory=list)
    experts: dict[str, str] = field(default_factory=lambda: dict(_EXPERT_NAMES))
    fused: dict[str, Fused] = field(default_factory=dict)  # HF layer suffix -> the titan_lite tensors it holds

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

    def fused_of(self, name: str) -> tuple[str, int, Fused] | None:
        """(HF name, index among its parts, Fused) of a titan_lite name held inside a fused HF tensor; else None."""
        match = _TITAN_LAYER.fullmatch(name)
        for hf, fused in self.fused.items() if match else ():
            if match.group(2) in fused.parts:
                return f"model.layers.{match.group(1)}.{hf}", fused.parts.index(match.group(2)), fused
        return None

    def fused_parts_of_hf(self, name: str) -> tuple[list[str], Fused] | None:
        """(titan_lite names, Fused) of a fused HF tensor's name; else None."""
        match = _HF_LAYER.fullmatch(name)
        if not match or match.group(2) not in self.fused:
            return None
        fused = self.fused[match.group(2)]
        return [f"layers.{match.group(1)}.{part}" for part in fused.parts], fused

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
        fused = self.fused_of(name)
        if fused is not None:
            return [fused[0]]
        return self.to_hf_experts(name, n_experts) if self.is_grouped(name) else [self.to_hf(name)]

    def readable_names(self, name: str, n_experts: int) -> list[str]:
        """Every HF name a titan_lite parameter may be read from: those it is written as, and one per expert where
        the family's folders may also hold a fused tensor that way (Qwen3.5-MoE)."""
        written = self.hf_names_of(name, n_experts)
        if self.fused_of(name) is not None and self.is_grouped(name):
            return [*written, *self.to_hf_experts(name, n_experts)]
        return written

    def for_family(self, family: str) -> "HFNames":
        """These names as a family's files spell them (Mixtral: block_sparse_moe.experts.{j}.w1, ...)."""
        renamed = FAMILIES[family].renames if family in FAMILIES else {}
        fused = FAMILIES[family].fused if family in FAMILIES else {}
        own = FAMILIES[family].layer_names if family in FAMILIES else {}
        if not renamed and not fused and not own:
            return self
        held = set() if FAMILIES[family].unfused_too else {part for f in fused.values() for part in f.parts}
        return replace(self, layer={**{t: renamed.get(h, h) for t, h in self.layer.items()}, **own},
                       experts={t: renamed.get(h, h) for t, h in self.experts.items() if t not in held},
                       fused=dict(fused))


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
    return [*sources, *multimodal_names(sources, args.family)]


def multimodal_names(hf_names: list[str], family: str) -> list[str]:
    """The names a family's multimodal folder gives the same text-model tensors (Qwen3.5: model.language_model.*)."""
    prefix = FAMILIES[family].text_prefix if family in FAMILIES else None
    if prefix is None:
        return []
    return [prefix + name.removeprefix("model.") for name in hf_names if name.startswith("model.")]


def skipped_tensor(hf: str, family: str, n_layers: int | None = None, n_mtp_layers: int = 0) -> str | None:
    """What an HF tensor is when the family's folders hold it for a part titan_lite does not build (Qwen3.5's vision
    encoder, its multi-token prediction head; DeepSeek-V3's multi-token prediction layers, numbered from n_layers
    on); None for the model's own tensors."""
    match = _HF_LAYER.fullmatch(hf)
    if match and n_layers is not None and n_layers <= int(match.group(1)) < n_layers + n_mtp_layers:
        return "multi-token prediction layers"
    skipped = FAMILIES[family].skipped if family in FAMILIES else {}
    return next((what for prefix, what in skipped.items() if hf.startswith(prefix)), None)
