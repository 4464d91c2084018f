"""Materialisation of structured pruning: a keep-set (layers, query/KV heads, FFN channels, hidden channels, soft
gate values) applied to a full Llama state dict gives the state dict and args of a smaller dense Llama.

The masked model this equals (STRUCTURED_SPEC.md): masked RMSNorm over the kept hidden channels, the embedding and
every block output multiplied by hidden_z, each query head's attention output by head_z, the SwiGLU product by
ffn_z, and each block's residual contributions by layer_z. Folding the gate values into the kept weights (embedding
columns and norm weights x hidden_z; wo columns x head_z; w2 columns x ffn_z; wo and w2 rows x hidden_z x layer_z)
makes the sliced model compute the same logits, because the masked residual stream is zero on pruned hidden dims.
"""

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from titan_lite.checkpoint.hf import expected_shapes, write_hf_folder
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.config import read_hf_config

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


@dataclass
class StructureKeep:
    """What survives structured pruning, in the ORIGINAL model's indices, plus soft gate values to fold in."""

    layers: list[int]  # kept block indices, ascending
    q_heads: list[list[int]]  # per kept layer: kept query heads (ascending); every kept KV head keeps the same
    # number of its own query heads (query head h uses KV head h // n_rep)
    kv_heads: list[list[int]]  # per kept layer: kept KV heads (ascending); same count in every layer
    ffn: list[list[int]]  # per kept layer: kept intermediate channels (ascending); same count everywhere
    hidden: list[int]  # kept model-dim channels (ascending)
    head_scale: list[Tensor] | None = None  # per kept layer, [len(q_heads[i])]
    ffn_scale: list[Tensor] | None = None  # per kept layer, [len(ffn[i])]
    hidden_scale: Tensor | None = None  # [len(hidden)]
    layer_scale: list[float] | None = None  # per kept layer


# ------------------------------------------------------------------------------------------ validation


def _check_indices(indices: list[int], size: int, what: str) -> None:
    if not indices:
        raise ValueError(f"keep-set: {what} keeps nothing")
    if any(not 0 <= i < size for i in indices):
        raise ValueError(f"keep-set: {what} has indices outside 0..{size - 1}: {indices}")
    if any(b <= a for a, b in zip(indices, indices[1:], strict=False)):
        raise ValueError(f"keep-set: {what} must be ascending without repeats: {indices}")


def _check_uniform(counts: list[int], what: str) -> None:
    if len(set(counts)) > 1:
        raise ValueError(f"keep-set: every kept layer must keep the same number of {what}; got {counts}")


def _check_lengths(keep: StructureKeep) -> None:
    n = len(keep.layers)
    per_layer = {"q_heads": keep.q_heads, "kv_heads": keep.kv_heads, "ffn": keep.ffn,
                 "head_scale": keep.head_scale, "ffn_scale": keep.ffn_scale, "layer_scale": keep.layer_scale}
    for name, values in per_layer.items():
        if values is not None and len(values) != n:
            raise ValueError(f"keep-set: {name} has {len(values)} entries for {n} kept layers")


def _check_scale(scale: Tensor | None, count: int, what: str) -> None:
    if scale is not None and tuple(scale.shape) != (count,):
        raise ValueError(f"keep-set: {what} has shape {list(scale.shape)}, expected [{count}]")


def _check_gqa(q_heads: list[int], kv_heads: list[int], n_rep: int, layer: int) -> None:
    """Every kept query head's KV head is kept, and each kept KV head serves the same number of query heads."""
    per_group = {kv: 0 for kv in kv_heads}
    for h in q_heads:
        if h // n_rep not in per_group:
            raise ValueError(f"keep-set: layer {layer} keeps query head {h} but drops its KV head {h // n_rep}")
        per_group[h // n_rep] += 1
    if len(set(per_group.values())) > 1:
        raise ValueError(f"keep-set: layer {layer} keeps query heads unevenly across its KV heads "
                         f"(KV head -> kept query heads: {per_group}); GQA needs the same count in every group")


def validate_keep(args: LlamaArgs, keep: StructureKeep) -> None:
    """One-line ValueError for a keep-set that gives no valid uniform GQA Llama."""
    _check_indices(keep.layers, args.n_layers, "layers")
    _check_indices(keep.hidden, args.dim, "hidden")
    _check_lengths(keep)
    for i, layer in enumerate(keep.layers):
        n_heads, n_kv = args.heads_of(layer)
        if n_heads % n_kv:
            raise ValueError(f"keep-set: layer {layer} of the source has {n_heads} heads, not divisible by its "
                             f"{n_kv} KV heads")
        _check_indices(keep.q_heads[i], n_heads, f"q_heads of layer {layer}")
        _check_indices(keep.kv_heads[i], n_kv, f"kv_heads of layer {layer}")
        _check_indices(keep.ffn[i], args.ffn_dim_of(layer), f"ffn of layer {layer}")
        _check_gqa(keep.q_heads[i], keep.kv_heads[i], n_heads // n_kv, layer)
        _check_scale(keep.head_scale[i] if keep.head_scale else None, len(keep.q_heads[i]), f"head_scale[{i}]")
        _check_scale(keep.ffn_scale[i] if keep.ffn_scale else None, len(keep.ffn[i]), f"ffn_scale[{i}]")
    _check_uniform([len(h) for h in keep.q_heads], "query heads")
    _check_uniform([len(h) for h in keep.kv_heads], "KV heads")
    _check_uniform([len(f) for f in keep.ffn], "FFN channels")
    _check_scale(keep.hidden_scale, len(keep.hidden), "hidden_scale")
    _check_sandwich(args, keep)


def _check_sandwich(args: LlamaArgs, keep: StructureKeep) -> None:
    """Gemma 3's blocks: a hidden size pruned would change the embedding's sqrt(dim) scale, and a gate folded into
    wo or w2 rows would be normed away by the post norm after it; heads, channels and whole blocks slice exactly."""
    if not (args.sandwich_norms or args.embed_scale):
        return
    if len(keep.hidden) != args.dim or keep.hidden_scale is not None or keep.layer_scale is not None:
        raise ValueError(f"keep-set: the {args.family} model's hidden size ({args.dim}) and block outputs cannot be "
                         "pruned or scaled (its sandwich norms and sqrt(dim) embedding scale); prune heads, MLP "
                         "channels or whole blocks")


# ------------------------------------------------------------------------------------------ slicing


def materialized_args(args: LlamaArgs, keep: StructureKeep) -> LlamaArgs:
    """The smaller model's args: uniform widths from the keep-set, head_dim unchanged (stated explicitly when it is
    no longer dim // n_heads)."""
    dim, n_heads = len(keep.hidden), len(keep.q_heads[0])
    head_dim = args.head_dim
    layer_types = None if args.layer_types is None else [args.layer_type(i) for i in keep.layers]
    return replace(args, dim=dim, n_layers=len(keep.layers), n_heads=n_heads, n_kv_heads=len(keep.kv_heads[0]),
                   ffn_dim=len(keep.ffn[0]), layer_n_heads=None, layer_n_kv_heads=None, layer_ffn_dims=None,
                   layer_types=layer_types,
                   explicit_head_dim=None if head_dim * n_heads == dim else head_dim,
                   tie_word_embeddings=args.tie_word_embeddings and keep.hidden_scale is None)


def head_rows(heads: list[int], head_dim: int) -> Tensor:
    """Row indices of the given heads in a [heads x head_dim, ...] projection."""
    return (torch.tensor(heads)[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def _scale_or_ones(scale: Tensor | float | None, count: int) -> Tensor:
    if scale is None:
        return torch.ones(count)
    return torch.as_tensor(scale, dtype=torch.float32).expand(count)


def _slice_block(sd: dict[str, Tensor], src: int, i: int, args: LlamaArgs, keep: StructureKeep,
                 hidden: Tensor, hidden_scale: Tensor) -> dict[str, Tensor]:
    """Kept layer i (source layer src), renamed layers.{i}, gate values folded in."""
    p, head_dim = f"layers.{src}.", args.head_dim
    q_rows, kv_rows = head_rows(keep.q_heads[i], head_dim), head_rows(keep.kv_heads[i], head_dim)
    ffn = torch.tensor(keep.ffn[i])
    layer_scale = _scale_or_ones(keep.layer_scale[i] if keep.layer_scale else None, 1)
    out_scale = (hidden_scale * layer_scale)[:, None]
    head_scale = _scale_or_ones(keep.head_scale[i] if keep.head_scale else None, len(keep.q_heads[i]))
    ffn_scale = _scale_or_ones(keep.ffn_scale[i] if keep.ffn_scale else None, len(ffn))
    wo = sd[p + "attention.wo.weight"][hidden][:, q_rows]
    wo = wo * head_scale.repeat_interleave(head_dim)[None, :].to(wo) * out_scale.to(wo)
    w2 = sd[p + "feed_forward.w2.weight"][hidden][:, ffn] * ffn_scale[None, :].to(wo) * out_scale.to(wo)
    q = f"layers.{i}."
    return {
        q + "attention_norm.weight": sd[p + "attention_norm.weight"][hidden] * hidden_scale.to(wo),
        q + "ffn_norm.weight": sd[p + "ffn_norm.weight"][hidden] * hidden_scale.to(wo),
        q + "attention.wq.weight": sd[p + "attention.wq.weight"][q_rows][:, hidden],
        q + "attention.wk.weight": sd[p + "attention.wk.weight"][kv_rows][:, hidden],
        q + "attention.wv.weight": sd[p + "attention.wv.weight"][kv_rows][:, hidden],
        q + "attention.wo.weight": wo,
        q + "feed_forward.w1.weight": sd[p + "feed_forward.w1.weight"][ffn][:, hidden],
        q + "feed_forward.w3.weight": sd[p + "feed_forward.w3.weight"][ffn][:, hidden],
        q + "feed_forward.w2.weight": w2,
        **_family_tensors(sd, p, q, q_rows, kv_rows),
    }


def _family_tensors(sd: dict[str, Tensor], p: str, q: str, q_rows: Tensor, kv_rows: Tensor) -> dict[str, Tensor]:
    """A kept layer's q/k/v biases (Qwen2: the kept heads' rows), q/k norm weights (Qwen3: one per head_dim
    channel, shared by every head, kept whole) and sandwich norm weights (Gemma 3: the hidden size is never pruned,
    so kept whole)."""
    out = {f"{q}{name}.weight": sd[f"{p}{name}.weight"].clone() for name in ("post_attention_norm", "post_ffn_norm")
           if f"{p}{name}.weight" in sd}
    for name, rows in (("wq", q_rows), ("wk", kv_rows), ("wv", kv_rows)):
        if f"{p}attention.{name}.bias" in sd:
            out[f"{q}attention.{name}.bias"] = sd[f"{p}attention.{name}.bias"][rows]
    for name in ("q_norm", "k_norm"):
        if f"{p}attention.{name}.weight" in sd:
            out[f"{q}attention.{name}.weight"] = sd[f"{p}attention.{name}.weight"].clone()
    return out


def materialize_state_dict(state_dict: dict[str, Tensor], args: LlamaArgs,
                           keep: StructureKeep) -> tuple[LlamaArgs, dict[str, Tensor]]:
    """titan_lite-named full (unsharded) state dict of the big model -> (args, state dict) of the smaller dense
    Llama; validates the keep-set (uniform counts, GQA-consistent, head_dim unchanged) with one-line ValueErrors.

    A tied model with a soft hidden_scale comes out untied: the embedding carries the scale, the head must not.
    """
    if args.is_hybrid or args.is_latent:
        return _whole_blocks(state_dict, args, keep)
    validate_keep(args, keep)
    new_args = materialized_args(args, keep)
    hidden = torch.tensor(keep.hidden)
    hidden_scale = _scale_or_ones(keep.hidden_scale, len(keep.hidden))
    embedding = state_dict["tok_embeddings.weight"]
    head = embedding if args.tie_word_embeddings else state_dict["output.weight"]
    out = {"tok_embeddings.weight": embedding[:, hidden] * hidden_scale.to(embedding)[None, :]}
    for i, src in enumerate(keep.layers):
        out.update(_slice_block(state_dict, src, i, args, keep, hidden, hidden_scale))
    out["norm.weight"] = state_dict["norm.weight"][hidden] * hidden_scale.to(embedding)
    if not new_args.tie_word_embeddings:
        out["output.weight"] = head[:, hidden].clone()
    return new_args, {name: t.contiguous() for name, t in out.items()}


def _whole_blocks(state_dict: dict[str, Tensor], args: LlamaArgs,
                  keep: StructureKeep) -> tuple[LlamaArgs, dict[str, Tensor]]:
    """A hybrid model (Qwen3.5) or DeepSeek-V3 loses whole blocks only: the kept blocks' tensors renamed in order,
    and the schedule made the kept blocks' types (an explicit layer_types, which the export writes;
    full_attention_interval no longer describes it) and dense layers (DeepSeek-V3's first_k_dense_replace). A
    keep-set that cuts heads or channels is one ValueError."""
    whole = depth_keep_of(args, keep.layers)
    cuts = [getattr(keep, f) != getattr(whole, f) for f in ("q_heads", "kv_heads", "ffn", "hidden")]
    scales = [s is not None for s in (keep.head_scale, keep.ffn_scale, keep.hidden_scale, keep.layer_scale)]
    if any(cuts) or any(scales):
        what = "latent attention (DeepSeek-V3)" if args.is_latent else "linear_attention (Gated DeltaNet) layers"
        raise ValueError(f"keep-set: a model with {what} can lose whole blocks only; its heads and channels are not "
                         "cut")
    _check_indices(keep.layers, args.n_layers, "layers")
    dense = [i for i, src in enumerate(keep.layers) if src in (args.moe_dense_layers or [])]
    new_args = replace(args, n_layers=len(keep.layers), layer_types=[args.layer_type(src) for src in keep.layers],
                       moe_dense_layers=dense or None)
    out = {}
    for name, tensor in state_dict.items():
        match = _LAYER.fullmatch(name)
        if match is None:
            out[name] = tensor
        elif int(match.group(1)) in keep.layers:
            out[f"layers.{keep.layers.index(int(match.group(1)))}.{match.group(2)}"] = tensor
    return new_args, {name: t.contiguous() for name, t in out.items()}


def depth_keep_of(args: LlamaArgs, layers: list[int]) -> StructureKeep:
    """These blocks kept whole (all heads, channels and hidden dims)."""
    return StructureKeep(layers=layers,
                         q_heads=[list(range(args.heads_of(i)[0])) for i in layers],
                         kv_heads=[list(range(args.heads_of(i)[1])) for i in layers],
                         ffn=[list(range(args.ffn_dim_of(i))) for i in layers],
                         hidden=list(range(args.dim)))


# ------------------------------------------------------------------------------------------ export


def write_materialized_hf(state_dict: dict[str, Tensor], args: LlamaArgs, out_dir: str | Path, dtype: torch.dtype,
                          assets_dir: str | None = None) -> None:
    """The smaller model as an HF folder (config.json with its shapes, tokenizer files from assets_dir), which
    transformers' LlamaForCausalLM loads and a titan_lite run starts from (`model.flavor = "hf"`,
    `model.hf_assets_path` = the folder, `checkpoint.initial_load_in_hf = true`)."""
    if args.layer_n_heads or args.layer_n_kv_heads or args.layer_ffn_dims:
        raise ValueError("per-layer widths cannot be written as a Hugging Face folder: transformers' LlamaConfig "
                         "holds one width per kind for every layer")
    source_config = Path(assets_dir) / "config.json" if assets_dir else None
    if source_config is not None and source_config.is_file():  # the pruned model keeps its source's context length
        source_length = int(read_hf_config(source_config).get("max_position_embeddings", 0))
        args = replace(args, max_seq_len=max(args.max_seq_len, source_length))
    write_hf_folder(state_dict, args, str(out_dir), dtype, assets_dir)


def param_count(args: LlamaArgs) -> int:
    """Parameters of a Llama with these args (a tied head counted once; q/k/v biases and q/k norms included); a
    hybrid model's (Qwen3.5) counted from its built shapes."""
    if args.is_hybrid or args.is_latent:
        return sum(math.prod(shape) for shape in expected_shapes(args).values())
    total = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2) + args.dim
    for layer in range(args.n_layers):
        q, kv = args.heads_of(layer)
        total += 2 * args.dim * args.head_dim * (q + kv) + 3 * args.dim * args.ffn_dim_of(layer) + 2 * args.dim
        total += family_layer_params(args, q, kv)
    return total


def family_layer_params(args: LlamaArgs, q_heads: float, kv_heads: float) -> float:
    """A layer's q/k/v bias entries (Qwen2), q/k norm weights (Qwen3) and sandwich norm weights (Gemma 3)."""
    biases = (q_heads + 2 * kv_heads) * args.head_dim if args.qkv_bias else 0
    return biases + (2 * args.head_dim if args.qk_norm else 0) + (2 * args.dim if args.sandwich_norms else 0)
