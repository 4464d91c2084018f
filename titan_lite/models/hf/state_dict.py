"""Tensors between layouts: the rotary permutation of q/k rows (interleaved pairs <-> HF's half-split, over the
rotated channels of each head, a gated wq's gate rows untouched), and whole
state dicts between titan_lite's names and layout and a family's HF ones (grouped experts <-> one tensor each)."""

import torch
from torch import Tensor

from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.names import LLAMA_NAMES

# Tensors whose rows (or, for the q/k norms, entries over head_dim) are rotary channels: permuted between layouts.
_ROTARY = ("attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias",
           "attention.q_norm.weight", "attention.k_norm.weight")


def _is_rotary(name: str) -> bool:
    return name.startswith("layers.") and name.endswith(_ROTARY)


def _rotary_block(name: str, args: LlamaArgs) -> int:
    """Rows per head of a rotary tensor: head_dim, or twice it for a gated wq (each head's [query | gate])."""
    gated = args.attn_output_gate and ".wq." in name
    return args.head_dim * (2 if gated else 1)


def _rotary_order(block: int, rotary_dim: int, to_hf: bool) -> Tensor:
    """The row order within one head's block taking interleaved rotary pairs to half-split (or back); rows past
    rotary_dim (partial rotation, the gate) keep their place."""
    half = rotary_dim // 2
    interleaved_of_half = torch.arange(rotary_dim).reshape(2, half).T.reshape(-1)  # titan row j <- HF row
    order = interleaved_of_half.argsort() if to_hf else interleaved_of_half
    return torch.cat([order, torch.arange(rotary_dim, block)])


def _permute_rotary(name: str, tensor: Tensor, args: LlamaArgs, to_hf: bool) -> Tensor:
    block = _rotary_block(name, args)
    order = _rotary_order(block, args.rotary_dim, to_hf)
    rows = tensor.reshape(-1, block, *tensor.shape[1:])
    return rows[:, order].reshape(tensor.shape)


# Latent attention's tensors whose rows end in rope channels: per head (the query's) or once (the rope key's)
_LATENT_ROPE = ("attention.wq.weight", "attention.q_b_proj.weight", "attention.kv_a_proj_with_mqa.weight")


def _permute_latent_rope(name: str, tensor: Tensor, args: LlamaArgs, to_hf: bool) -> Tensor:
    """DeepSeek-V3 with rope_interleave false: each query head's rope rows (after its nope rows) and the rope key's
    rows (after the latent's) between rotate-half and interleaved pairs."""
    rope = args.qk_rope_head_dim
    block = args.qk_nope_head_dim + rope if ".kv_a_proj" not in name else args.kv_lora_rank + rope
    order = torch.cat([torch.arange(block - rope), block - rope + _rotary_order(rope, rope, to_hf)])
    return tensor.reshape(-1, block, *tensor.shape[1:])[:, order].reshape(tensor.shape)


def _relaid(name: str, tensor: Tensor, args: LlamaArgs, to_hf: bool) -> Tensor:
    if args.is_latent:  # its wq (q_proj) holds nope and rope rows per head: not the rotary layout of attention's
        latent_rope = not args.rope_interleave and name.endswith(_LATENT_ROPE)
        return _permute_latent_rope(name, tensor, args, to_hf) if latent_rope else tensor
    if _is_rotary(name):
        return _permute_rotary(name, tensor, args, to_hf)
    return tensor


def tensor_to_hf(name: str, tensor: Tensor, args: LlamaArgs) -> Tensor:
    """A titan_lite tensor in HF layout (q/k rows, biases and norm weights permuted; latent attention's rope rows
    where the checkpoint pairs them rotate-half; others unchanged)."""
    return _relaid(name, tensor, args, to_hf=True)


def tensor_from_hf(name: str, tensor: Tensor, args: LlamaArgs) -> Tensor:
    """An HF tensor in titan_lite layout; `name` is the titan_lite name."""
    return _relaid(name, tensor, args, to_hf=False)


def _converted_name(convert, name: str) -> str:
    try:
        return convert(name)
    except KeyError as exc:
        raise ConfigError(f"tensor {exc.args[0]}") from None


def to_hf_state_dict(sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """titan_lite names and layout -> HF; lm_head.weight is omitted when the embeddings are tied; grouped expert
    weights become one tensor per expert."""
    out, names, fused = {}, LLAMA_NAMES.for_family(args.family), {}
    for name, tensor in sd.items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue
        held = names.fused_of(name)
        if held is not None:
            fused.setdefault(held[0], {})[held[1]] = tensor
            if len(fused[held[0]]) == len(held[2].parts):
                out[held[0]] = held[2].join([fused[held[0]][i] for i in range(len(held[2].parts))])
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
        fused = names.fused_parts_of_hf(name)
        if fused is not None:
            out.update(zip(fused[0], fused[1].split(tensor), strict=True))
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
