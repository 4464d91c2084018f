"""From trained gate logits to the pruned model: deterministic masks with the exact target counts, the keep-set."""

import logging

import torch

from titan_lite.models.args import LlamaArgs
from titan_lite.transforms.sheared.modules import deterministic_mask
from titan_lite.transforms.sheared.targets import Targets
from titan_lite.transforms.structured.materialize import StructureKeep, materialize_state_dict, param_count

logger = logging.getLogger("titan_lite")
GATE_PREFIX = "sheared_gates."


def final_masks(log_alphas: dict[str, torch.Tensor], targets: Targets) -> dict[str, torch.Tensor]:
    """Per pruned type (gate shape): the soft values of the top-k gates of each row, k the exact target count."""
    return {kind: deterministic_mask(v.detach().float().cpu(), targets.kept_per_row(kind))
            for kind, v in log_alphas.items()}


def _kept(row: torch.Tensor) -> list[int]:
    return torch.nonzero(row).flatten().tolist()


def _heads_of_layer(z: torch.Tensor | None, targets: Targets) -> tuple[list[int], list[int], torch.Tensor | None]:
    """(query heads, KV heads, per-query-head scale) one layer keeps under its head gates (None: all, unscaled)."""
    a, n_rep = targets.args, targets.n_rep
    if z is None:
        return list(range(a.n_heads)), list(range(a.kv_heads)), None
    if targets.head_mode == "per_group_query":  # gate s: slot s of every KV group
        slots = _kept(z)
        q = [g * n_rep + s for g in range(a.kv_heads) for s in slots]
        return q, list(range(a.kv_heads)), torch.stack([z[h % n_rep] for h in q])
    groups = _kept(z)  # kv_group: gate g: KV head g with its query heads
    q = [g * n_rep + r for g in groups for r in range(n_rep)]
    return q, groups, torch.stack([z[h // n_rep] for h in q])


def keep_from_masks(z: dict[str, torch.Tensor], targets: Targets) -> StructureKeep:
    """The keep-set of deterministic masks (gate shape, zeros for pruned units, soft values for kept ones)."""
    a = targets.args
    layers = _kept(z["layer"]) if "layer" in z else list(range(a.n_layers))
    heads = [_heads_of_layer(z["head"][layer] if "head" in z else None, targets) for layer in layers]
    ffn = [_kept(z["intermediate"][layer]) if "intermediate" in z else list(range(a.ffn_dim)) for layer in layers]
    hidden = _kept(z["hidden"]) if "hidden" in z else list(range(a.dim))
    return StructureKeep(
        layers=layers, q_heads=[q for q, _, _ in heads], kv_heads=[kv for _, kv, _ in heads], ffn=ffn, hidden=hidden,
        head_scale=[scale for _, _, scale in heads] if "head" in z else None,
        ffn_scale=[z["intermediate"][layer][f] for layer, f in zip(layers, ffn, strict=True)]
        if "intermediate" in z else None,
        hidden_scale=z["hidden"][hidden] if "hidden" in z else None,
        layer_scale=[z["layer"][layer].item() for layer in layers] if "layer" in z else None)


def materialize_pruned(state_dict: dict[str, torch.Tensor], args: LlamaArgs,
                       targets: Targets) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
    """A full state dict of the gated model -> the pruned dense model's (gates dropped, soft values folded)."""
    log_alphas = {kind: state_dict[f"{GATE_PREFIX}{kind}_log_alpha"] for kind in targets.pruned}
    keep = keep_from_masks(final_masks(log_alphas, targets), targets)
    plain = {name: t for name, t in state_dict.items() if not name.startswith(GATE_PREFIX)}
    new_args, new_sd = materialize_state_dict(plain, args, keep)
    logger.info(f"sheared: materialised {param_count(args):,} -> {param_count(new_args):,} parameters: "
                f"{new_args.n_layers} layers, {new_args.n_heads} heads / {new_args.kv_heads} KV heads, dim "
                f"{new_args.dim}, intermediate {new_args.ffn_dim} (kept layers {keep.layers})")
    return new_sd, new_args
