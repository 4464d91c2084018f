"""Learning-rate schedule shapes: warmup, stable, decay curves, and the greedy schedule's adaptation."""

import math

import pytest
import torch

from titan_lite.config import parse_args
from titan_lite.optim.lr_scheduler import LRSchedule, wsd_factor


def schedule(argv: list[str], steps: int = 10) -> LRSchedule:
    cfg = parse_args(["--optimizer.lr", "1.0", *argv])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    return LRSchedule([opt], cfg.lr_scheduler, steps)


def lrs(s: LRSchedule, n: int, losses=None) -> list[float]:
    out = []
    for i in range(n):
        out.append(s.last_lr())
        s.step(None if losses is None else losses[i])
    return out


def test_linear_warmup_then_linear_decay():
    got = lrs(schedule(["--lr_scheduler.warmup_steps", "3"], steps=8), 8)
    expected = [1 / 4, 2 / 4, 3 / 4, 0.8, 0.6, 0.4, 0.2, 0.0]  # decay ends at min_lr_factor on the last step
    assert got == pytest.approx(expected)


def test_warmup_stable_decay_with_cosine_and_floor():
    s = schedule(["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.4",
                  "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.min_lr_factor", "0.1"], steps=10)
    got = lrs(s, 10)
    # 2 warmup, 4 stable, 4 decay steps
    assert got[:2] == pytest.approx([1 / 3, 2 / 3])
    assert got[2:6] == pytest.approx([1.0] * 4)
    decay = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(1, 5)]
    assert got[6:] == pytest.approx(decay)
    assert got[-1] == pytest.approx(0.1)


def test_sqrt_decay():
    assert wsd_factor(5, 0, 10, None, "sqrt", 0.0) == pytest.approx(1 - math.sqrt(0.6))


def test_total_steps_decouples_from_training_steps():
    s = schedule(["--lr_scheduler.warmup_steps", "0", "--lr_scheduler.total_steps", "100"], steps=10)
    assert lrs(s, 3) == pytest.approx([0.99, 0.98, 0.97])


def test_greedy_raises_while_improving_and_lowers_while_worsening():
    argv = ["--lr_scheduler.name", "greedy", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.greedy_factor", "2",
            "--lr_scheduler.greedy_patience", "3", "--lr_scheduler.greedy_smoothing", "0",
            "--lr_scheduler.greedy_max_lr_factor", "4", "--lr_scheduler.greedy_min_lr_factor", "0.25"]
    s = schedule(argv, steps=40)
    improving = [10 - 0.1 * i for i in range(14)]
    got = lrs(s, 14, improving)
    # warmup; the first loss after it sets the baseline; then x2 after every 3 improving steps, capped at 4
    assert got[:2] == pytest.approx([1 / 3, 2 / 3])
    assert got[2:14] == pytest.approx([1, 1, 1, 1, 2, 2, 2, 4, 4, 4, 4, 4])
    worsening = [20 + i for i in range(12)]
    got = lrs(s, 12, worsening)
    assert got == pytest.approx([4, 4, 4, 2, 2, 2, 1, 1, 1, 0.5, 0.5, 0.5])
    state = s.state_dict()
    again = schedule(argv, steps=40)
    again.load_state_dict(state)
    assert again.last_lr() == s.last_lr() and again.greedy.state_dict() == s.greedy.state_dict()


def test_greedy_respects_floor_and_cooldown():
    argv = ["--lr_scheduler.name", "greedy", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.greedy_factor", "2",
            "--lr_scheduler.greedy_patience", "1", "--lr_scheduler.greedy_smoothing", "0",
            "--lr_scheduler.greedy_min_lr_factor", "0.25", "--lr_scheduler.greedy_cooldown", "1"]
    s = schedule(argv, steps=20)
    got = lrs(s, 8, [5.0] + [6.0 + i for i in range(7)])
    # the first loss sets the baseline; each worse step halves, then one cooldown step; never below 0.25
    assert got == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25])


def test_warmup_ratio_is_a_fraction_of_the_schedule_length():
    by_ratio = lrs(schedule(["--lr_scheduler.warmup_ratio", "0.3"], steps=10), 10)
    assert by_ratio == lrs(schedule(["--lr_scheduler.warmup_steps", "3"], steps=10), 10)
    by_total = schedule(["--lr_scheduler.warmup_ratio", "0.1", "--lr_scheduler.total_steps", "50"], steps=10)
    assert by_total.cfg.warmup_steps == 5
