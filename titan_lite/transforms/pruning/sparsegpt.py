"""SparseGPT (Frantar & Alistarh, 2023): the input Hessian of a linear, its inverse's Cholesky factor, and the
column-by-column pruning with optimal-brain-surgeon updates of the weights not yet visited."""

import logging

import torch
import torch.distributed as dist

from titan_lite.transforms.pruning.masks import Pattern, lowest_in_layer, lowest_per_row

logger = logging.getLogger("titan_lite")
# Dampening grows tenfold per failed Cholesky factorisation, at most this many times.
MAX_DAMPING_RETRIES = 4


class Hessian:
    """Sum over calibration tokens of x xᵀ (fp32, [in, in]); its scale does not matter to the algorithm."""

    def __init__(self, in_features: int, device: torch.device):
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)

    def add(self, x: torch.Tensor) -> None:
        """x: [tokens, in] activations (any float dtype)."""
        x = x.float()
        self.sum.addmm_(x.t(), x)

    def all_reduce(self, group) -> None:
        dist.all_reduce(self.sum, group=group)


def inverse_hessian_factor(hessian: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, dead): the upper Cholesky factor of the dampened H⁻¹ and the inputs that never fired (H_ii = 0).

    Row i of U is H_F⁻¹'s first row over the columns F = {i, ...} not yet visited, divided by the square root of
    its first entry: everything the column-by-column updates need. `hessian` is modified in place (dead inputs
    get H_ii = 1, the diagonal gets percdamp x its mean).
    """
    diag = hessian.diagonal()
    dead = diag == 0
    diag[dead] = 1.0
    damp = percdamp * diag.mean()
    diag += damp
    for attempt in range(MAX_DAMPING_RETRIES + 1):
        lower, info = torch.linalg.cholesky_ex(hessian)
        if int(info) == 0:
            break
        if attempt == MAX_DAMPING_RETRIES:
            raise torch.linalg.LinAlgError("the dampened Hessian is not positive definite; raise 'pruning.percdamp' "
                                           "or calibrate on more samples")
        diag += 9 * damp  # ten times the dampening so far
        damp = 10 * damp
        logger.warning(f"SparseGPT: Hessian not positive definite; dampening raised to {damp.item():.3g}")
    inverse = torch.cholesky_inverse(lower)
    del lower
    return torch.linalg.cholesky(inverse, upper=True), dead


def sparsegpt_prune(weight: torch.Tensor, factor: torch.Tensor, dead: torch.Tensor, sparsity: float,
                    pattern: Pattern, blocksize: int) -> torch.Tensor:
    """Prune `weight` [out, in] in place (fp32 or fp64, full) and return the pruned positions (bool).

    Columns are visited in blocks of `blocksize`. Unstructured: each block prunes the lowest w² / U_ii² of the
    whole [out, blocksize] block. N:M: in every group of m columns, each row prunes its n lowest saliencies at the
    moment the group is reached. Each visited column's error is spread over the columns not yet visited (inside the
    block at once, to later blocks in one matmul at the end of the block).
    """
    rows, cols = weight.shape
    weight[:, dead] = 0
    pruned = torch.zeros(rows, cols, dtype=torch.bool, device=weight.device)
    for start in range(0, cols, blocksize):
        end = min(start + blocksize, cols)
        block = weight[:, start:end].clone()
        block_factor = factor[start:end, start:end]
        d = block_factor.diagonal()
        errors = torch.zeros_like(block)
        if pattern.structured:
            block_pruned = torch.zeros_like(block, dtype=torch.bool)
        else:
            block_pruned = lowest_in_layer(block ** 2 / d[None, :] ** 2, int(block.numel() * sparsity))
        for i in range(end - start):
            if pattern.structured and i % pattern.m == 0:
                group = slice(i, i + pattern.m)
                block_pruned[:, group] = lowest_per_row(block[:, group] ** 2 / d[None, group] ** 2, pattern.n)
            w = block[:, i]
            q = w.masked_fill(block_pruned[:, i], 0.0)
            err = (w - q) / d[i]
            block[:, i:] -= err[:, None] * block_factor[i, i:][None, :]
            block[:, i] = q  # exactly zero where pruned (the update above gives q only up to rounding)
            errors[:, i] = err
        weight[:, start:end] = block
        weight[:, end:] -= errors @ factor[start:end, end:]
        pruned[:, start:end] = block_pruned
    return pruned
