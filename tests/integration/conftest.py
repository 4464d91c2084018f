"""Runs shared by the integration modules: the uninterrupted 20-step reference on one process."""

import pytest

from tests.integration.harness import run_train, steps


@pytest.fixture(scope="session")
def reference_1p(tmp_path_factory) -> dict[int, float]:
    """20 uninterrupted steps on 1 process, no checkpointing: the losses every resumed run must reproduce."""
    run = run_train(steps(20), tmp_path_factory.mktemp("ref1"))
    assert run.returncode == 0, run.output[-3000:]
    losses = run.tb_losses()
    assert sorted(losses) == list(range(1, 21))
    return losses
