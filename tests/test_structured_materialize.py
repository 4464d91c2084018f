"""Materialising a structured keep-set: the smaller dense Llama equals an independent masked forward of the big one
(STRUCTURED_SPEC.md semantics), and its HF export loads in transformers with the same logits."""

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from titan_lite.checkpoint.hf import read_hf_folder
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.hf.config import args_from_hf_config
from titan_lite.transforms.structured.materialize import (
    StructureKeep,
    materialize_state_dict,
    param_count,
    write_materialized_hf,
)

SEQ, BATCH = 24, 2

# ------------------------------------------------------------------------ the masked reference (spec semantics)


def rotate_interleaved(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... of x [batch, seq, heads, head_dim]."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    cos, sin = angles.cos().float()[None, :, None, :], angles.sin().float()[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def masked_norm(x: torch.Tensor, weight: torch.Tensor, hidden_z: torch.Tensor, eps: float) -> torch.Tensor:
    m = (hidden_z != 0).to(x)
    var = (x * x * m).sum(-1, keepdim=True) / m.sum()
    return weight * x * torch.rsqrt(var + eps) * hidden_z


def masked_forward(sd: dict, args: LlamaArgs, tokens: torch.Tensor, masks: dict) -> torch.Tensor:
    """The full-size model with layer_z [L], head_z [L, n_heads], ffn_z [L, ffn_dim], hidden_z [dim]."""
    hz, eps, hd = masks["hidden"], args.norm_eps, args.head_dim
    n_rep = args.n_heads // args.kv_heads
    batch, seq = tokens.shape
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    h = sd["tok_embeddings.weight"][tokens] * hz
    for layer in range(args.n_layers):
        w = {k.removeprefix(f"layers.{layer}."): v for k, v in sd.items() if k.startswith(f"layers.{layer}.")}
        x = masked_norm(h, w["attention_norm.weight"], hz, eps)
        q, k, v = (head_projection(x, w, name, hd) for name in ("q", "k", "v"))
        q, k = rotate_interleaved(q, args.rope_theta), rotate_interleaved(k, args.rope_theta)
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd) + causal
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v) * masks["head"][layer][None, None, :, None]
        h = h + masks["layer"][layer] * ((attn.reshape(batch, seq, -1) @ w["attention.wo.weight"].T) * hz)
        x = masked_norm(h, w["ffn_norm.weight"], hz, eps)
        gated = F.silu(x @ w["feed_forward.w1.weight"].T) * ((x @ w["feed_forward.w3.weight"].T) * masks["ffn"][layer])
        h = h + masks["layer"][layer] * ((gated @ w["feed_forward.w2.weight"].T) * hz)
    head = sd["tok_embeddings.weight"] if args.tie_word_embeddings else sd["output.weight"]
    return masked_norm(h, sd["norm.weight"], hz, eps) @ head.T


def head_projection(x: torch.Tensor, w: dict, name: str, head_dim: int) -> torch.Tensor:
    """[batch, seq, heads, head_dim] of wq/wk/wv, with its bias (Qwen2) and, for q and k, the RMSNorm over head_dim
    (Qwen3) when the layer has them."""
    out = x @ w[f"attention.w{name}.weight"].T + w.get(f"attention.w{name}.bias", 0.0)
    out = out.view(*x.shape[:2], -1, head_dim)
    norm = w.get(f"attention.{name}_norm.weight")
    return out if norm is None else norm * out * torch.rsqrt(out.square().mean(-1, keepdim=True) + 1e-6)


def masks_of(keep: StructureKeep, args: LlamaArgs) -> dict:
    """Full-size masks: the keep-set's scale (1 without one) on kept positions, 0 elsewhere."""
    layer_z, head_z = torch.zeros(args.n_layers), torch.zeros(args.n_layers, args.n_heads)
    ffn_z, hidden_z = torch.zeros(args.n_layers, args.ffn_dim), torch.zeros(args.dim)
    hidden_z[keep.hidden] = keep.hidden_scale if keep.hidden_scale is not None else 1.0
    for i, layer in enumerate(keep.layers):
        layer_z[layer] = keep.layer_scale[i] if keep.layer_scale else 1.0
        head_z[layer, keep.q_heads[i]] = keep.head_scale[i] if keep.head_scale else 1.0
        ffn_z[layer, keep.ffn[i]] = keep.ffn_scale[i] if keep.ffn_scale else 1.0
    return {"layer": layer_z, "head": head_z, "ffn": ffn_z, "hidden": hidden_z}


# ------------------------------------------------------------------------------------------ fixtures


def source_model(tied: bool = False, flavor: str = "tiny") -> tuple[LlamaArgs, dict]:
    """A tiny flavor (4 layers, 4 heads, 2 KV heads, dim 64, ffn 192) with random weights, norms (and q/k/v biases)
    included."""
    args = replace(flavor_args(flavor), max_seq_len=SEQ, tie_word_embeddings=tied)
    model = Llama(args)
    model.init_weights(seed=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            if name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    return args, {name: t.detach().clone() for name, t in model.state_dict().items() if "rope" not in name}


def sorted_sample(generator: torch.Generator, size: int, count: int) -> list[int]:
    return sorted(torch.randperm(size, generator=generator)[:count].tolist())


def make_keep(case: str, args: LlamaArgs) -> StructureKeep:
    g = torch.Generator().manual_seed(7)
    n = args.n_layers
    keep = StructureKeep(layers=list(range(n)), q_heads=[list(range(args.n_heads))] * n,
                         kv_heads=[list(range(args.kv_heads))] * n, ffn=[list(range(args.ffn_dim))] * n,
                         hidden=list(range(args.dim)))
    if case in ("heads_in_groups", "combined"):  # one of the 2 query heads of each KV group, varying by layer
        keep.q_heads = [[0, 3], [1, 2], [1, 3], [0, 2]]
    if case == "kv_groups":  # one whole KV group (its 2 query heads) per layer
        keep.kv_heads, keep.q_heads = [[1], [0], [0], [1]], [[2, 3], [0, 1], [0, 1], [2, 3]]
    if case in ("ffn", "combined"):
        keep.ffn = [sorted_sample(g, args.ffn_dim, 100) for _ in range(n)]
    if case in ("hidden", "combined"):
        keep.hidden = sorted_sample(g, args.dim, 40)
    if case in ("layers", "combined"):
        keep.layers = [0, 2, 3]
        keep.q_heads, keep.kv_heads, keep.ffn = keep.q_heads[:3], keep.kv_heads[:3], keep.ffn[:3]
    if case == "combined":  # soft gate values, folded into the weights
        keep.head_scale = [0.3 + torch.rand(len(h), generator=g) for h in keep.q_heads]
        keep.ffn_scale = [0.3 + torch.rand(len(f), generator=g) for f in keep.ffn]
        keep.hidden_scale = 0.3 + torch.rand(len(keep.hidden), generator=g)
        keep.layer_scale = [0.5, 0.8, 1.2]
    return keep


def materialized_logits(new_args: LlamaArgs, sd: dict, tokens: torch.Tensor) -> torch.Tensor:
    model = Llama(new_args)
    model.init_weights()  # the RoPE cache
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert [m for m in missing if "rope" not in m] == [] and unexpected == []
    with torch.no_grad():
        return model(tokens)


CASES = [("tiny", case) for case in ("heads_in_groups", "kv_groups", "ffn", "hidden", "layers", "combined")]
# The families: heads removed with their q/k/v bias entries (Qwen2.5), the q/k norms over head_dim kept (Qwen3).
CASES += [(flavor, case) for flavor in ("tiny_qwen2", "tiny_qwen3") for case in ("kv_groups", "combined")]


@pytest.mark.parametrize("flavor, case", CASES, ids=["-".join(c) for c in CASES])
def test_materialized_equals_masked(flavor, case):
    args, sd = source_model(flavor=flavor)
    keep = make_keep(case, args)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    new_args, new_sd = materialize_state_dict(sd, args, keep)
    reference = masked_forward(sd, args, tokens, masks_of(keep, args))
    assert (materialized_logits(new_args, new_sd, tokens) - reference).abs().max() < 1e-5
    assert new_args.head_dim == args.head_dim
    assert sum(t.numel() for t in new_sd.values()) == param_count(new_args)


def test_tied_model_with_soft_hidden_scale_comes_out_untied():
    args, sd = source_model(tied=True)
    keep = make_keep("combined", args)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    new_args, new_sd = materialize_state_dict(sd, args, keep)
    assert not new_args.tie_word_embeddings and "output.weight" in new_sd
    reference = masked_forward(sd, args, tokens, masks_of(keep, args))
    assert (materialized_logits(new_args, new_sd, tokens) - reference).abs().max() < 1e-5
    binary = replace(keep, hidden_scale=None)
    assert materialize_state_dict(sd, args, binary)[0].tie_word_embeddings


@pytest.mark.parametrize("flavor", ["tiny", "tiny_qwen2", "tiny_qwen3"])
def test_hf_export_loads_in_transformers(tmp_path, flavor):
    transformers = pytest.importorskip("transformers")
    args, sd = source_model(flavor=flavor)
    new_args, new_sd = materialize_state_dict(sd, args, make_keep("combined", args))
    write_materialized_hf(new_sd, new_args, tmp_path / "hf", torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["head_dim"]) == (
        40, 3, 2, 2, 100, args.head_dim)
    assert config["model_type"] == args.family
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert (theirs - materialized_logits(new_args, new_sd, tokens)).abs().max() < 1e-4
    # titan_lite reads the folder back with the same shapes (head_dim stated explicitly) and weights
    back_args = args_from_hf_config(config)
    assert back_args == replace(new_args, max_seq_len=back_args.max_seq_len)
    back = read_hf_folder(str(tmp_path / "hf"), back_args)
    assert all(torch.equal(back[name], new_sd[name]) for name in new_sd)


def broken(args: LlamaArgs, **changes) -> StructureKeep:
    return replace(make_keep("heads_in_groups", args), **changes)


@pytest.mark.parametrize("changes, message", [
    ({"ffn": [list(range(10))] * 3 + [list(range(11))]}, r"same number of FFN channels; got \[10, 10, 10, 11\]"),
    ({"q_heads": [[0, 1]] * 4}, "layer 0 keeps query heads unevenly across its KV heads"),
    ({"kv_heads": [[0]] * 4, "q_heads": [[0, 2]] * 4}, "layer 0 keeps query head 2 but drops its KV head 1"),
    ({"layers": [2, 1, 3, 0]}, "layers must be ascending"),
    ({"hidden": [0, 64]}, "hidden has indices outside 0..63"),
    ({"layer_scale": [1.0]}, "layer_scale has 1 entries for 4 kept layers"),
])
def test_invalid_keep_sets_are_one_line_errors(changes, message):
    args, sd = source_model()
    with pytest.raises(ValueError, match=message) as info:
        materialize_state_dict(sd, args, broken(args, **changes))
    assert "\n" not in str(info.value)


def test_source_heads_must_divide_by_kv_heads():
    args = replace(flavor_args("tiny"), layer_n_heads=[3, 4, 4, 4])
    with pytest.raises(ValueError, match="layer 0 of the source has 3 heads, not divisible by its 2 KV heads"):
        materialize_state_dict({}, args, broken(args))
