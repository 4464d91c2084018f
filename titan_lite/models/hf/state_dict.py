"""Tensors between layouts: the rotary permutation of q/k rows (interleaved pairs <-> HF's half-split), and whole
state dicts between titan_lite's names and layout and a family's HF ones (grouped experts <-> one tensor each)."""

import torch
from torch import Tensor

from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.names import LLAMA_NAMES

# Tensors whose rows (or, for the q/k norms, entries over head_dim) are rotary channels: permuted between layouts.
_ROTARY = ("attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias",
           "attention.q_norm.weight", "attention.k_norm.weight")


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
