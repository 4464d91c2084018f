"""LoRA on an MoE layer's grouped experts: each expert's own low-rank factors held as grouped tensors A [E, r, in]
and B [E, out, r], applied to the routed rows as two grouped matmuls (no expert's delta weight is ever formed), in
PEFT's form for transformers' fused experts (target_parameters mlp.experts.gate_up_proj / down_proj): gate and up
share one A per expert, their B rows stacked (gate first), as on the fused [E, 2 x hidden, dim] weight."""

import torch
from torch import nn

from titan_lite.dtensor import local_tensor
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.families import FAMILIES, Fused
from titan_lite.models.parts.experts import GroupedExperts, grouped_mm
from titan_lite.transforms.lora.module import kaiming_uniform_a
from titan_lite.transforms.lora.options import pattern_matches

# The adapted groups of projections: titan_lite's adapter name -> (the grouped weights it adapts, in the order of
# their output rows; the HF fused parameter PEFT targets).
EXPERT_ADAPTERS = {"gate_up": (("w1", "w3"), "mlp.experts.gate_up_proj"), "down": (("w2",), "mlp.experts.down_proj")}


class GroupedLoRA(nn.Module):
    """The adapters of one group of expert projections: lora_a [E, rank, in], lora_b [E, out, rank] (out: the rows
    of every projection of the group, stacked)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, rank: int, scale: float):
        super().__init__()
        self.rank, self.scale = rank, scale
        self.lora_a = nn.Parameter(torch.empty(n_experts, rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(n_experts, out_features, rank))

    def param_init(self) -> dict:
        """PEFT's: each expert's A uniform within 1 / sqrt(in) (kaiming), B zero (the model starts as the base)."""
        return {"lora_a": lambda t, g: kaiming_uniform_a(t.view(-1, t.shape[-1]), g), "lora_b": _zeros}

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """scale x B_e (A_e x) for each row x of expert e's group: [tokens, out]."""
        down = grouped_mm(x, _as(self.lora_a, x), counts)
        return self.scale * grouped_mm(down, _as(self.lora_b, x), counts)

    def extra_repr(self) -> str:
        n_experts, rank, fan_in = self.lora_a.shape
        return f"experts={n_experts}, in={fan_in}, out={self.lora_b.shape[1]}, rank={rank}, scale={self.scale:.6g}"


def _zeros(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return tensor.zero_()


def _as(param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The local parameter (replicated over TP) in x's dtype."""
    local = local_tensor(param)
    return local if local.dtype == x.dtype else local.to(x.dtype)


class LoRAGroupedExperts(GroupedExperts):
    """GroupedExperts with adapters (submodules gate_up and/or down, GroupedLoRA) added to their projections'
    outputs; the same interface for expert parallelism (forward(x, counts)); EP shards the adapters' E dimension
    with the experts'."""

    def __init__(self, dim: int, hidden: int, n_experts: int, adapters: dict[str, GroupedLoRA], **base):
        super().__init__(dim, hidden, n_experts, **base)  # base: the activation and biases of the adapted experts
        for name, adapter in adapters.items():
            self.add_module(name, adapter)
        self.adapted = tuple(adapters)
        self.adapters_off = False  # set by adapters_off(): the experts compute their base function

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate, up = self.project("w1", x, counts), self.project("w3", x, counts)
        if "gate_up" in self.adapted and not self.adapters_off:
            update = self.gate_up(x, counts)
            gate, up = gate + update[:, :gate.shape[1]], up + update[:, gate.shape[1]:]
        h = self.activate(gate, up)
        out = self.project("w2", h, counts)
        if "down" in self.adapted and not self.adapters_off:
            out = out + self.down(h, counts)
        return out


def adapted_experts(experts: GroupedExperts, adapters: dict[str, tuple[int, float]],
                    module_class: type = LoRAGroupedExperts) -> LoRAGroupedExperts:
    """A LoRAGroupedExperts (or `module_class`, a subclass) in place of `experts` (on its device, the meta device in
    convert), with one GroupedLoRA per adapted group: adapters maps gate_up / down to (rank, scale)."""
    n_experts, hidden, dim = experts.w1.shape
    widths = {"gate_up": (dim, 2 * hidden), "down": (hidden, dim)}
    with torch.device(experts.w1.device):
        modules = {name: GroupedLoRA(n_experts, *widths[name], rank, scale)
                   for name, (rank, scale) in adapters.items()}
        return module_class(dim, hidden, n_experts, modules, activation=experts.activation,
                            bias=experts.b1 is not None, alpha=experts.alpha, limit=experts.limit)


def check_expert_options(options, args, keep_sparsity: bool) -> None:
    """Refusals of [lora] settings LoRA on experts does not have, each one line (PEFT's target_parameters has none
    of them either)."""
    if args.expert_bias and "experts" in options.train_modules:
        raise ConfigError("'lora.train_modules' has 'experts': training gpt-oss's experts in full has no PEFT form "
                          "here yet (modules_to_save would need its fused, biased experts); adapt them with "
                          "'lora.target_modules' = 'experts'")
    if not options.expert_groups or not args.n_experts:
        return
    c = options.section
    refused = [("use_dora", c.use_dora, "DoRA's per-row magnitude of a grouped weight"),
               ("init", c.init != "default" and c.init != "gaussian", "PiSSA's SVD of every expert"),
               ("dropout", c.dropout > 0, "dropout (the low-rank path cannot be factored out of a grouped matmul)"),
               ("keep_sparsity", keep_sparsity, "masked updates"),
               ("refactor_freq", c.refactor_freq > 0, "re-factoring"),
               ("adapter_path", c.adapter_path is not None, "starting from a PEFT adapter"),
               ("base_dtype", c.base_dtype == "nf4", "an NF4 base (no NF4 grouped matmul: the experts, most of the "
                                                     "model, would stay unquantized)")]
    for key, on, what in refused:
        if on:
            raise ConfigError(f"'lora.{key}' = {getattr(c, key)!r}: LoRA on experts ('lora.target_modules' names "
                              f"experts) does not support {what}; turn it off or adapt only attention and dense "
                              "projections")
    for key, entries in (("rank_pattern", options.rank_pattern), ("alpha_pattern", options.alpha_pattern)):
        for pattern, value in entries:
            if any(pattern_matches(pattern, m) for m in options.adapted_expert_groups(args)):
                raise ConfigError(f"'lora.{key}' entry '{pattern}={value:g}' matches an expert group: PEFT's "
                                  "target_parameters take the section's r and lora_alpha")


# ------------------------------------------------------------------------------------------ merge and PEFT


def expert_adapter_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """The expert groups (layers.{i}.moe.experts.gate_up / down) a state dict holds adapters of."""
    return [n.removesuffix(".lora_a") for n in state
            if n.endswith(".lora_a") and n.rsplit(".", 2)[-2] in EXPERT_ADAPTERS and ".moe.experts." in n]


def merge_expert_adapters(state: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """The state dict with each adapted expert weight merged, W_e + scale B_e A_e per expert (float32, then the
    weight's dtype), and the expert adapters dropped; `scales` gives each group's scale."""
    out = dict(state)
    for module in expert_adapter_modules(state):
        experts, group = module.rsplit(".", 1)
        delta = scales[module] * torch.bmm(out.pop(f"{module}.lora_b").float(), out.pop(f"{module}.lora_a").float())
        row = 0
        for name in EXPERT_ADAPTERS[group][0]:
            weight = out[f"{experts}.{name}"]
            rows = weight.shape[1]
            out[f"{experts}.{name}"] = (weight.float() + delta[:, row:row + rows]).to(weight.dtype)
            row += rows
    return out


def family_gate_up(args: LlamaArgs) -> Fused | None:
    """The family's own fused gate_up_proj where it has one (gpt-oss), else None (transformers' gate rows first)."""
    family = FAMILIES.get(args.family)
    return family.fused.get("mlp.experts.gate_up_proj") if family else None


def fused_output_order(gate_up: Fused, rows: int) -> torch.Tensor:
    """Which of titan_lite's stacked gate and up rows (gate first) each output of the family's fused gate_up_proj is:
    its own join of the row indices (gpt-oss interleaves them across its transposed [E, dim, 2 hidden]; Qwen3.5-MoE's
    [E, 2 hidden, dim] keeps them in order)."""
    index = torch.arange(rows, dtype=torch.float64).view(1, rows, 1)
    return gate_up.join(list(index.chunk(2, dim=1))).flatten().long()


def peft_expert_tensors(state: dict[str, torch.Tensor], prefix: str,
                        gate_up: Fused | None = None) -> dict[str, torch.Tensor]:
    """PEFT's tensors of the expert adapters (and of fully trained experts) in a state dict, as peft 0.21 writes
    them for target_parameters ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] on transformers' fused experts:
    one ParamWrapper per parameter, nested in that order (so gate_up's lives under `base_layer` when down_proj is
    adapted too); lora_A [E x r, in] (row e r + j), lora_B [out, r x E] (column j E + e). `gate_up`: the family's
    own fused gate_up_proj (gpt-oss's [E, dim, 2 hidden], gate and up columns interleaved), whose output order B's
    rows then follow."""
    out = {}
    for module in expert_adapter_modules(state):
        experts, group = module.rsplit(".", 1)
        layer = experts.split(".")[1]
        nested = group == "gate_up" and f"{experts}.down.lora_a" in state
        path = f"{prefix}model.layers.{layer}.mlp.experts." + ("base_layer." if nested else "")
        a, b = state[f"{module}.lora_a"], state[f"{module}.lora_b"]
        if group == "gate_up" and gate_up is not None:  # B's rows in the fused tensor's output order
            b = b[:, fused_output_order(gate_up, b.shape[1]).to(b.device)]
        out[f"{path}lora_A.weight"] = a.reshape(-1, a.shape[-1])
        out[f"{path}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
    return out


def peft_target_parameters(state: dict[str, torch.Tensor]) -> list[str]:
    """adapter_config.json's target_parameters for the expert groups a state dict adapts, in PEFT's nesting order."""
    groups = {m.rsplit(".", 1)[1] for m in expert_adapter_modules(state)}
    return [EXPERT_ADAPTERS[g][1] for g in EXPERT_ADAPTERS if g in groups]


def fused_expert_weights(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Fully trained experts (train_modules 'experts') as transformers 5 holds them, for PEFT's modules_to_save:
    mlp.experts.gate_up_proj [E, 2 x hidden, dim] (gate rows first) and mlp.experts.down_proj [E, dim, hidden]."""
    out = {}
    for name in [n for n in state if n.endswith(".moe.experts.w1")]:
        experts = name.removesuffix(".w1")
        layer = experts.split(".")[1]
        path = f"{prefix}model.layers.{layer}.mlp.experts"
        out[f"{path}.gate_up_proj"] = torch.cat([state[f"{experts}.w1"], state[f"{experts}.w3"]], dim=1)
        out[f"{path}.down_proj"] = state[f"{experts}.w2"]
    return out
