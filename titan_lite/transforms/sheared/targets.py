"""Sheared pruning targets: unit counts per gate type from the [sheared] section, their checks, the size formula."""

from dataclasses import dataclass

from titan_lite.config.schema import Sheared
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.transforms.structured.materialize import family_layer_params

# Gate types, in the order of the Lagrange multiplier rows.
KINDS = ("layer", "head", "intermediate", "hidden")


@dataclass(frozen=True)
class Targets:
    """Full and target counts of the model, and the gate layout: `head_slots` gates per layer for heads, one per
    query slot of a KV group (per_group_query) or one per KV group (kv_group)."""

    args: LlamaArgs
    head_mode: str
    layers: int
    heads: int
    kv_heads: int
    dim: int
    intermediate: int

    @property
    def n_rep(self) -> int:
        return self.args.n_heads // self.args.kv_heads

    @property
    def head_slots(self) -> int:
        return self.n_rep if self.head_mode == "per_group_query" else self.args.kv_heads

    def gate_shape(self, kind: str) -> tuple[int, ...]:
        a = self.args
        return {"layer": (a.n_layers,), "head": (a.n_layers, self.head_slots),
                "intermediate": (a.n_layers, a.ffn_dim), "hidden": (a.dim,)}[kind]

    def kept_per_row(self, kind: str) -> int:
        """Gates kept in each row at the target (a row: the model for layer/hidden, a layer for head/intermediate)."""
        heads_kept = self.heads // self.kv_heads if self.head_mode == "per_group_query" else self.kv_heads
        return {"layer": self.layers, "head": heads_kept, "intermediate": self.intermediate, "hidden": self.dim}[kind]

    def target_sparsity(self, kind: str) -> float:
        return 1.0 - self.kept_per_row(kind) / self.gate_shape(kind)[-1]

    @property
    def pruned(self) -> tuple[str, ...]:
        """Gate types whose target removes something (the others get no gates)."""
        return tuple(k for k in KINDS if self.kept_per_row(k) < self.gate_shape(k)[-1])

    def param_count(self) -> int:
        """Parameters of the target architecture (dense, uniform layers)."""
        return round(expected_params(self.args, self.layers, [self.heads] * self.layers,
                                     [self.kv_heads] * self.layers, [self.intermediate] * self.layers, self.dim))


def expected_params(args: LlamaArgs, layers, q_heads, kv_heads, ffn, dim) -> float:
    """Parameters of a Llama with `layers` (a count, or per-layer keep probabilities summing to one), per-layer
    (expected) query heads, KV heads and intermediate sizes, and (expected) model dim. GQA-aware: q and o cost
    2 d head_dim per query head, k and v 2 d head_dim per KV head; norms, embeddings and the head included.
    With counts it is the dense model's exact count; with independent gate probabilities it is the expectation."""
    hd = args.head_dim
    layer_probs = layers if isinstance(layers, (list, tuple)) else [1.0] * int(layers)
    per_layer = sum(p * (2 * dim * hd * (q + kv) + 3 * dim * f + 2 * dim + family_layer_params(args, q, kv))
                    for p, q, kv, f in zip(layer_probs, q_heads, kv_heads, ffn, strict=True))
    embeddings = args.vocab_size * dim * (1 if args.tie_word_embeddings else 2)
    return float(per_layer + embeddings + dim)


def _count(explicit: int | None, sparsity: float, full: int) -> int:
    return explicit if explicit is not None else max(1, round(full * (1 - sparsity)))


def targets_from_config(s: Sheared, args: LlamaArgs) -> Targets:
    """The target architecture from targets or sparsities, validated against the model (one-line ConfigErrors)."""
    if args.layer_n_heads or args.layer_n_kv_heads or args.layer_ffn_dims:
        raise ConfigError("'model.converters' has 'sheared' but the model has per-layer widths; Sheared pruning "
                          "needs a uniform model")
    n_kv, n_rep = args.kv_heads, args.n_heads // args.kv_heads
    layers = _count(s.target_layers, s.layer_sparsity, args.n_layers)
    dim = _count(s.target_dim, s.hidden_sparsity, args.dim)
    intermediate = _count(s.target_intermediate, s.intermediate_sparsity, args.ffn_dim)
    if s.head_mode == "per_group_query":
        heads = s.target_heads if s.target_heads is not None else n_kv * _count(None, s.head_sparsity, n_rep)
        kv_heads = n_kv
        if n_rep == 1 and (s.target_heads is not None or s.head_sparsity > 0):
            raise ConfigError("'sheared.head_mode' = 'per_group_query' cannot prune heads of a model without GQA "
                              "(one query head per KV head); set 'sheared.head_mode' = 'kv_group'")
        if heads % n_kv:
            raise ConfigError(f"'sheared.target_heads' = {heads} must be a multiple of the model's {n_kv} KV heads "
                              "with 'sheared.head_mode' = 'per_group_query' (every KV head keeps as many query heads)")
    else:
        kv_heads = s.target_kv_heads
        if kv_heads is None:
            kv_heads = s.target_heads // n_rep if s.target_heads is not None else _count(None, s.head_sparsity, n_kv)
        heads = kv_heads * n_rep
        if s.target_heads is not None and s.target_heads != heads:
            raise ConfigError(f"'sheared.target_heads' = {s.target_heads} must be {heads} with 'sheared.head_mode' = "
                              f"'kv_group': {kv_heads} KV heads x {n_rep} query heads each")
    for key, value, full in (("target_layers", layers, args.n_layers), ("target_heads", heads, args.n_heads),
                             ("target_kv_heads", kv_heads, n_kv), ("target_dim", dim, args.dim),
                             ("target_intermediate", intermediate, args.ffn_dim)):
        if value > full:
            raise ConfigError(f"'sheared.{key}' = {value} exceeds the model's {full}")
    tp = s.target_tp_degree
    for key, value in (("target_heads", heads), ("target_kv_heads", kv_heads), ("target_intermediate", intermediate)):
        if value % tp:
            raise ConfigError(f"'sheared.target_tp_degree' = {tp} must divide the pruned model's {key[7:]} "
                              f"({value}); choose other targets or another degree")
    return Targets(args, s.head_mode, layers, heads, kv_heads, dim, intermediate)
