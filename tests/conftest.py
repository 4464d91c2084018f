"""Fixtures for every test: each test starts with the `titan_lite` logger as the previous test found it."""

import logging

import pytest


@pytest.fixture(autouse=True)
def restore_titan_lite_logger():
    """train.main() and MetricsProcessor call init_logger(), which stops propagation to the root logger (and so to
    pytest's caplog); undo that after each test so later tests see the logger as they would alone."""
    log = logging.getLogger("titan_lite")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield
    log.handlers[:] = handlers
    log.setLevel(level)  # setLevel, not .level: it also clears the loggers' cached isEnabledFor answers
    log.propagate = propagate
