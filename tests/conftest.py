"""Fixtures for every test: each test ends with the `titan_lite` logger as the session found it, the rendezvous
environment as the test found it and no default process group."""

import logging

import pytest

_LOG = logging.getLogger("titan_lite")
_LOG_AT_START = (list(_LOG.handlers), _LOG.level, _LOG.propagate)


@pytest.fixture(autouse=True)
def restore_titan_lite_logger():
    """train.main() and MetricsProcessor call init_logger(), which stops propagation to the root logger (and so to
    pytest's caplog); undo that after each test so later tests see the logger as they would alone: as the session
    found it, not as the test found it (a module-scoped fixture that ran a script has changed it before its first
    test starts)."""
    yield
    log = _LOG
    handlers, level, propagate = _LOG_AT_START
    log.handlers[:] = handlers
    log.setLevel(level)  # setLevel, not .level: it also clears the loggers' cached isEnabledFor answers
    log.propagate = propagate


def pytest_configure(config):
    """The gloo workers of tests/helpers.py start from a forkserver that has imported torch."""
    import multiprocessing

    from tests.helpers import FORKSERVER_PRELOAD

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)


@pytest.fixture(autouse=True, scope="session")
def warm_run_train(tmp_path_factory):
    """run_train.sh's python, forked from a server that imported torch and titan_lite once (tests/warm_python.py):
    the launches of the session skip ~4 s of CPU each. TITAN_LITE_TEST_WARM=0 runs every launch cold."""
    import os

    if os.environ.get("TITAN_LITE_TEST_WARM") == "0":
        yield
        return
    from tests import warm_python

    server, venv = warm_python.start(tmp_path_factory.mktemp("warm_python"))
    before = os.environ.get("TITAN_LITE_VENV")
    os.environ["TITAN_LITE_VENV"] = str(venv)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TITAN_LITE_VENV")
        else:
            os.environ["TITAN_LITE_VENV"] = before
        server.kill()
        server.wait()


RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True, scope="module")
def restore_rendezvous_environment_after_the_module():
    """The same around each test file: a module fixture's process group sets these for all of the file's tests, and
    the next file in the same process (the suite runs each file in one worker) must not find them."""
    yield from _restoring_rendezvous_environment()


@pytest.fixture(autouse=True)
def restore_rendezvous_environment():
    """A test that starts a process group in its own process sets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE for it;
    put them back after each test, so a later test's launches do not rendezvous on that port."""
    yield from _restoring_rendezvous_environment()


def _restoring_rendezvous_environment():
    import os

    saved = {k: os.environ.get(k) for k in RENDEZVOUS_ENV}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True, scope="module")
def destroy_leftover_process_group_after_the_module():
    """The same around each test file, for a group a module fixture started and left."""
    yield from _destroying_a_new_process_group()


@pytest.fixture(autouse=True)
def destroy_leftover_process_group():
    """A Trainer built in the test's process initialises a one-process group and keeps it (run_train.sh's process
    ends there); destroy it after the test, so that a later test in the same process (the suite runs each file's tests
    in one worker) that plans ranks with a fake group, or starts its own, does not find it."""
    yield from _destroying_a_new_process_group()


def _destroying_a_new_process_group():
    import torch.distributed as dist

    there = dist.is_available() and dist.is_initialized()  # a module fixture's group is kept for its other tests
    yield
    if not there and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# Slow without a mark of their own: every integration test launches ./run_train.sh (a fresh torch process, often
# torchrun with 2 ranks, more than one run per test), and these unit tests run whole benchmark or training processes.
SLOW_PATHS = ("tests/integration/", "tests/test_benchmarks.py::test_benchmark_runs_a_tiny_case_and_writes_json",
              "tests/test_benchmarks.py::test_paired_worker_alternates_both_steps_in_one_process")


# Files whose one slow test runs for minutes: first of all, whatever their count of slow tests.
LONGEST_SINGLE_TESTS = ("tests/integration/test_user_runs.py", "tests/test_gpu_lane.py",
                        "tests/test_offline_install.py")


def heaviest_files_first(items: list) -> list:
    """The files with the most slow tests first, each file's tests together and in their order (module fixtures are
    set up once). The suite's workers start with contiguous shares and an idle one takes over the end of a busy one's
    queue, so the long tests start early and the last ones to run are short: no worker waits alone at the end on a
    long test that happened to come last."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    def weight(tests: list) -> tuple[bool, int]:
        first = tests[0].nodeid.startswith(LONGEST_SINGLE_TESTS)
        return not first, -sum(t.get_closest_marker("slow") is not None for t in tests)

    order = sorted(files.values(), key=weight)
    return [item for tests in order for item in tests]


def pytest_collection_modifyitems(config, items):
    """`slow`: the tests above as well as those marked; `cuda` tests need a CUDA device: skipped, with the reason,
    where torch sees none."""
    import os

    import torch

    for item in items:
        if item.nodeid.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
    items[:] = heaviest_files_first(items)

    if torch.cuda.is_available() or os.environ.get("TITAN_LITE_CUDA_TESTS_ON_CPU") == "1":  # see tests/test_cuda.py
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False); the GPU lane runs it: "
                                   "python -m benchmarks.gpu --cases correctness")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
