"""float8 training converges like high precision: 100 steps with tensorwise and rowwise float8 against the same run
without float8, compared on the mean loss of the last 10 steps.

The issue asks for the debug model; this uses the tiny flavor (every block linear is float8-servable, 28 of them)
because emulated float8 on the debug model measured 10 s a step on this CPU under load (3 steps in 30 s with
`--model.flavor debugmodel`), i.e. about 50 minutes for the three 100-step runs; these three took 126 s together
(under the same load), so the test is marked slow.
"""

import pytest

from tests.integration.harness import run_train

STEPS, LAST = 100, 10
# Measured (this test, tiny flavor, 100 steps): last-10 means 6.2618 without float8, 6.2627 tensorwise, 6.2635
# rowwise, i.e. float8 moved them by under 0.002; the loss fell by ~1.9 over the run. 0.01 leaves 5x that margin.
TOLERANCE = 0.01
COMMON = ["--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "1",
          "--optimizer.lr", "3e-3", "--training.local_batch_size", "8"]


def last_mean(losses: dict[int, float]) -> float:
    assert sorted(losses) == list(range(1, STEPS + 1)), sorted(losses)[-3:]
    return sum(losses[s] for s in range(STEPS - LAST + 1, STEPS + 1)) / LAST


@pytest.mark.slow
def test_tensorwise_and_rowwise_converge_like_high_precision(tmp_path):
    means = {}
    for name, extra in [("none", []), ("tensorwise", ["--model.converters", "quantize.linear.float8"]),
                        ("rowwise", ["--model.converters", "quantize.linear.float8",
                                     "--quantize.linear.float8.recipe_name", "rowwise"])]:
        run = run_train([*COMMON, *extra], tmp_path / name)
        assert run.returncode == 0, run.output[-3000:]
        losses = run.tb_losses()
        means[name] = last_mean(losses)
        assert means[name] < losses[1] - 1.0, (name, losses[1], means[name])  # it learned
    print(f"last-{LAST}-step mean loss: {means}")
    for recipe in ("tensorwise", "rowwise"):
        assert abs(means[recipe] - means["none"]) <= TOLERANCE, means
