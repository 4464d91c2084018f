"""OWL's layer-wise sparsity (outlier-weighted, Yin et al. 2024, github luuyin/OWL): a layer with more outlier Wanda
scores is pruned less, the layers' sparsities averaging to the requested one.

As the reference code (lib/prune_all.py, prune_wanda_outlier and its magnitude and SparseGPT siblings) computes it:
D_l = 100 x the share of the Wanda scores |W_ij| x ||x_j|| of all of layer l's linears (together) above M x their
mean, on the dense model (each block sees the dense blocks' outputs); then r = (D - min D) / (max D - min D) x 2
lambda, r = r - mean(r) + (1 - S), and layer l's sparsity is 1 - r_l, so the sparsities average exactly S and span
2 lambda. (Wanda's statistic is the sum of x_j^2 over the tokens; the reference divides it by the sample count, a
factor common to every score of a layer, which changes no share above a multiple of the mean.)
"""

import torch


class OutlierCount:
    """Layer l's D_l from its linears' scores, one linear at a time: `add` every linear's scores to the sum first,
    then `count` each against M x the mean (the full weights are scored twice rather than held together)."""

    def __init__(self, m: float):
        self.m = m
        self.total = torch.zeros((), dtype=torch.float64)
        self.numel = 0
        self.above = 0

    def add(self, scores: torch.Tensor) -> None:
        self.total += scores.sum(dtype=torch.float64).cpu()
        self.numel += scores.numel()

    def threshold(self) -> float:
        return float(self.m * self.total / max(self.numel, 1))

    def count(self, scores: torch.Tensor) -> None:
        self.above += int((scores > self.threshold()).sum())

    @property
    def ratio(self) -> float:
        """D_l: the percentage of the layer's scores above M x their mean."""
        return 100.0 * self.above / max(self.numel, 1)


def owl_sparsities(outlier_ratios: list[float], sparsity: float, lam: float) -> list[float]:
    """Each layer's sparsity from its outlier ratio D_l (OWL's formula; equal ratios give every layer `sparsity`)."""
    d = torch.tensor(outlier_ratios, dtype=torch.float64)
    spread = d.max() - d.min()
    if spread == 0:
        return [sparsity] * len(outlier_ratios)
    r = (d - d.min()) / spread * (2 * lam)
    r = r - r.mean() + (1 - sparsity)
    return (1 - r).tolist()
