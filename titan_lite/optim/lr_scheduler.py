"""Learning-rate schedules: warmup-stable-decay (linear, sqrt, cosine) and the adaptive greedy schedule."""

import dataclasses
import math

import torch

from titan_lite.config.schema import LRScheduler


def wsd_factor(step: int, warmup: int, total: int, decay_ratio: float | None, decay_type: str,
               min_factor: float) -> float:
    """LR multiplier after `step` optimizer steps: linear warmup, a stable phase, then decay to min_factor.

    decay_ratio None decays straight after warmup. Warmup starts at 1/(warmup+1), never at zero.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_steps = total - warmup if decay_ratio is None else round(total * decay_ratio)
    decay_steps = max(0, min(decay_steps, total - warmup))
    decay_start = total - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    if decay_type == "linear":
        curve = 1.0 - progress
    elif decay_type == "sqrt":
        curve = 1.0 - math.sqrt(progress)
    else:
        curve = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * curve


class GreedyState:
    """Raises the LR factor while the smoothed loss keeps improving, lowers it while it keeps worsening."""

    def __init__(self, cfg: LRScheduler):
        self.cfg = cfg
        self.factor = 1.0
        self.smoothed: float | None = None
        self.best = math.inf
        self.good = self.bad = self.cooldown = 0

    def update(self, loss: float) -> None:
        c = self.cfg
        if self.smoothed is None:  # the first loss only sets the baseline
            self.smoothed = self.best = loss
            return
        self.smoothed = c.greedy_smoothing * self.smoothed + (1 - c.greedy_smoothing) * loss
        if self.smoothed < self.best:
            self.best, self.good, self.bad = self.smoothed, self.good + 1, 0
        else:
            self.good, self.bad = 0, self.bad + 1
        if self.cooldown > 0:
            self.cooldown -= 1
            return
        if self.good >= c.greedy_patience:
            self._change(min(self.factor * c.greedy_factor, c.greedy_max_lr_factor))
        elif self.bad >= c.greedy_patience:
            self._change(max(self.factor / c.greedy_factor, c.greedy_min_lr_factor))

    def _change(self, factor: float) -> None:
        self.factor, self.good, self.bad, self.cooldown = factor, 0, 0, self.cfg.greedy_cooldown

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("factor", "smoothed", "best", "good", "bad", "cooldown")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


class LRSchedule:
    """Sets every param group's lr to its base lr times the schedule factor; checkpointable."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], cfg: LRScheduler, training_steps: int):
        self.optimizers = optimizers
        self.total = cfg.total_steps or training_steps
        if cfg.warmup_ratio is not None:
            cfg = dataclasses.replace(cfg, warmup_steps=round(cfg.warmup_ratio * self.total))
        self.cfg = cfg
        self.step_count = 0
        self.greedy = GreedyState(cfg) if cfg.name == "greedy" else None
        for opt in optimizers:
            for group in opt.param_groups:
                group.setdefault("initial_lr", group["lr"])
        self._apply()

    def factor(self) -> float:
        c = self.cfg
        if c.name == "greedy":
            warm = (self.step_count + 1) / (c.warmup_steps + 1) if self.step_count < c.warmup_steps else 1.0
            return warm * self.greedy.factor
        return wsd_factor(self.step_count, c.warmup_steps, self.total, c.decay_ratio, c.decay_type, c.min_lr_factor)

    def step(self, loss: float | None = None) -> None:
        """Advance one optimizer step; the greedy schedule reads the step's global loss (after warmup)."""
        if self.greedy is not None and loss is not None and self.step_count >= self.cfg.warmup_steps:
            self.greedy.update(loss)
        self.step_count += 1
        self._apply()

    def _apply(self) -> None:
        f = self.factor()
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * f

    def last_lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "greedy": self.greedy.state_dict() if self.greedy else None}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step_count"]
        if self.greedy is not None and state.get("greedy") is not None:
            self.greedy.load_state_dict(state["greedy"])
        self._apply()
