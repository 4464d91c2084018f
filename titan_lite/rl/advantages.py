"""Group advantages and the rollout's reward metrics, as TRL's GRPOTrainer computes them (sum_then_normalize): each
completion's reward minus its group's mean, divided by the group's std (or the whole batch's, or not at all) plus
1e-4; a completion no function scored (every reward None) gets advantage 0 and stays out of the means; a warning when
no group's rewards have spread for several rollouts in a row (every advantage 0: nothing to learn from)."""

import logging

import torch

logger = logging.getLogger(__name__)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel's correction) ignoring NaN; NaN with fewer than two values."""
    kept = ~values.isnan()
    count = kept.sum(dim=dim, keepdim=dim is not None)
    mean = values.nanmean(dim=dim, keepdim=dim is not None)
    variance = ((values - mean) ** 2).nansum(dim=dim, keepdim=dim is not None) / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))


def group_advantages(rewards: torch.Tensor, group: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], whether each completion's std is zero [N]) of rewards [N] in groups of `group` consecutive
    completions; `scale` is 'group', 'batch' or 'none'."""
    grouped = rewards.view(-1, group)
    mean = grouped.nanmean(dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).squeeze(1).repeat_interleave(group)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def reward_metrics(scores: torch.Tensor, totals: torch.Tensor, names: list[str],
                   zero_std: torch.Tensor) -> dict[str, float]:
    """TRL's reward metrics of a rollout: reward, reward_std, rewards/<name>/mean and /std, frac_reward_zero_std."""
    metrics = {"reward": totals.nanmean().item(), "reward_std": nanstd(totals).item()}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = scores[:, i].nanmean().item()
        metrics[f"rewards/{name}/std"] = nanstd(scores[:, i]).item()
    metrics["frac_reward_zero_std"] = zero_std.float().mean().item()
    return metrics


class ZeroSpreadWatch:
    """Warns once when frac_reward_zero_std has been 1 for `patience` rollouts in a row (again after a rollout with
    spread): every completion scored as its group's others, so every advantage is 0 and the steps train nothing."""

    def __init__(self, patience: int = 3):
        self.patience, self.run = patience, 0

    def update(self, frac_zero_std: float) -> None:
        self.run = self.run + 1 if frac_zero_std >= 1.0 else 0
        if self.run == self.patience:
            logger.warning(f"grpo: no group's rewards have differed for {self.run} rollouts in a row "
                           "(frac_reward_zero_std = 1): every advantage is 0, so these steps learn nothing; check "
                           "the rewards on a few completions (validation.sample_outputs), or raise grpo.temperature "
                           "or grpo.num_generations")
