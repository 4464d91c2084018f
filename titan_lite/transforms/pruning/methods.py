"""The one-shot methods behind one interface: the statistics each collects per linear input, and how it prunes one
full weight matrix. Magnitude needs no data; Wanda scores |W| x ||x_j||; SparseGPT updates the kept weights."""

import torch
import torch.distributed as dist

from titan_lite.config.schema import Pruning
from titan_lite.transforms.pruning.masks import Pattern, pruned_positions
from titan_lite.transforms.pruning.sparsegpt import Hessian, inverse_hessian_factor, sparsegpt_prune


class InputSquares:
    """Wanda's statistic: the sum over calibration tokens of x_j² per input channel j, in float64 (so that any
    split of the tokens over ranks sums to the same fp32 score)."""

    def __init__(self, in_features: int, device: torch.device):
        self.sum = torch.zeros(in_features, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        """x: [tokens, in] activations (any float dtype)."""
        x = x.float()
        self.sum += (x * x).sum(0, dtype=torch.float64)

    def all_reduce(self, group) -> None:
        dist.all_reduce(self.sum, group=group)


class Method:
    """How one method prunes. `statistics` makes the accumulator a group of linears sharing one input fills;
    `prepare` turns the all-reduced statistics into what `prune` needs (once per group); `prune` takes the full
    fp32 weight and the layer's sparsity, may update the weight in place (`updates_weights`), and returns the pruned
    positions."""

    needs_calibration = True
    updates_weights = False

    def __init__(self, cfg: Pruning):
        self.sparsity = cfg.sparsity
        self.pattern = Pattern.parse(cfg.pattern)
        self.cfg = cfg

    def statistics(self, in_features: int, device: torch.device):
        return None

    def prepare(self, stats):
        return None

    def prune(self, weight: torch.Tensor, prepared, sparsity: float) -> torch.Tensor:
        raise NotImplementedError


class Magnitude(Method):
    """|W|, one threshold over the whole layer (N:M: per group)."""

    needs_calibration = False

    def prune(self, weight: torch.Tensor, prepared, sparsity: float) -> torch.Tensor:
        return pruned_positions(weight.abs(), sparsity, self.pattern, per_row=False)


class Wanda(Method):
    """|W_ij| x ||x_j||₂ over the calibration tokens, compared within each output row (N:M: per group)."""

    def statistics(self, in_features: int, device: torch.device) -> InputSquares:
        return InputSquares(in_features, device)

    def prepare(self, stats: InputSquares) -> torch.Tensor:
        return stats.sum.sqrt().float()

    def prune(self, weight: torch.Tensor, norms: torch.Tensor, sparsity: float) -> torch.Tensor:
        return pruned_positions(weight.abs() * norms[None, :], sparsity, self.pattern, per_row=True)


class SparseGPT(Method):
    """Hessian-based pruning with weight updates (block size and dampening from the config)."""

    updates_weights = True

    def statistics(self, in_features: int, device: torch.device) -> Hessian:
        return Hessian(in_features, device)

    def prepare(self, stats: Hessian) -> tuple[torch.Tensor, torch.Tensor]:
        return inverse_hessian_factor(stats.sum, self.cfg.percdamp)

    def prune(self, weight: torch.Tensor, prepared: tuple[torch.Tensor, torch.Tensor], sparsity: float) -> torch.Tensor:
        factor, dead = prepared
        return sparsegpt_prune(weight, factor, dead, sparsity, self.pattern, self.cfg.blocksize)


METHODS = {"magnitude": Magnitude, "wanda": Wanda, "sparsegpt": SparseGPT}


def build_method(cfg: Pruning) -> Method:
    return METHODS[cfg.method](cfg)


def calibrates(cfg: Pruning) -> bool:
    """Whether the pass reads calibration data: the method's statistics, or OWL's outlier scores (magnitude too)."""
    return build_method(cfg).needs_calibration or cfg.layer_ratios == "owl"
