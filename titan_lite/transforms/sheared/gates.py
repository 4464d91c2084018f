"""Hard-concrete gates (Louizos et al.; Sheared LLaMA's constants): sampling, P(z > 0), deterministic soft values."""

import math

import torch

BETA = 2.0 / 3.0  # temperature
GAMMA = -0.1  # stretch interval (gamma, zeta)
ZETA = 1.1
EPS = 1e-6  # the uniform noise stays in (EPS, 1 - EPS)
LOG_ALPHA_INIT_MEAN = 5.0
LOG_ALPHA_INIT_STD = 0.01
LOG_ALPHA_MIN = math.log(0.01)
LOG_ALPHA_MAX = math.log(100.0)
DETERMINISTIC_SHARPNESS = 0.8  # the reference's multiplier of log_alpha / beta in the deterministic soft value
# P(z > 0) = sigmoid(log_alpha - BETA * log(-GAMMA / ZETA)): this offset is 1.5986.
NONZERO_OFFSET = -BETA * math.log(-GAMMA / ZETA)


def init_log_alpha(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """N(5, 0.01), as the reference (clamped to LOG_ALPHA_MAX by the first clamp)."""
    torch.nn.init.normal_(tensor, LOG_ALPHA_INIT_MEAN, LOG_ALPHA_INIT_STD, generator=generator)


def uniform_noise(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32) * (1 - 2 * EPS) + EPS


def sample(log_alpha: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """z = hardtanh(sigmoid((log u - log(1 - u) + log_alpha) / beta) * (zeta - gamma) + gamma, 0, 1)."""
    s = torch.sigmoid((noise.log() - (1 - noise).log() + log_alpha.float()) / BETA)
    return (s * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)


def prob_nonzero(log_alpha: torch.Tensor) -> torch.Tensor:
    """P(z > 0) of each gate, in closed form (differentiable in log_alpha)."""
    return torch.sigmoid(log_alpha.float() + NONZERO_OFFSET)


def soft_value(log_alpha: torch.Tensor) -> torch.Tensor:
    """The deterministic gate value folded into the weights of the kept units: sigmoid(log_alpha / beta * 0.8)."""
    return torch.sigmoid(log_alpha.float() / BETA * DETERMINISTIC_SHARPNESS)


def keep_top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending indices of the `count` highest scores of a 1-D tensor (ties: the lower index)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:count].sort().values
