"""The training loss: token-sum cross entropy with IGNORE_INDEX, and whether it is compiled."""

import torch
import torch.nn.functional as F

from titan_lite.config.schema import Compile

# Labels with this value carry no loss (padding, prompt tokens of instruction data).
IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses, so the caller can normalise by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def build_loss_fn(compile_cfg: Compile, loss_parallel: bool):
    """cross_entropy_sum, compiled when `compile.components` has 'loss' (and loss parallel is off: compiled, cross
    entropy ignores loss_parallel()'s handlers and normalises each vocab shard on its own, a silently wrong loss)."""
    if compile_cfg.enable and "loss" in compile_cfg.components and not loss_parallel:
        return torch.compile(cross_entropy_sum, backend=compile_cfg.backend)
    return cross_entropy_sum
