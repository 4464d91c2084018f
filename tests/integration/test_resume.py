"""Exact resume through ./run_train.sh: 1 process, 2 FSDP processes, 2 -> 1 resharding, and a save killed midway.

Every run uses `lr_scheduler.total_steps 20`, so a 10-step run follows the same LR schedule as the first 10
steps of a 20-step run and its checkpoint can be continued to step 20.
"""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import BASE_TOML, REPO, run_train
from titan_lite.checkpoint.manager import STALL_SECONDS_ENV, STALL_STEP_ENV
from titan_lite.data.datasets import BUNDLED_DATASETS
from titan_lite.data.tokenizer import build_tokenizer

SCHEDULE = ["--lr_scheduler.total_steps", "20", "--checkpoint.interval", "5",
            "--checkpoint.last_save_model_only", "false"]
CKPT = ["--checkpoint.enable"]
RESUME_TB = ["--metrics.save_tb_folder", "tb_resume"]  # the resumed run's losses, apart from the first run's
SEQ, BATCH, PERIOD_STEPS = 64, 8, 10


def steps(n: int) -> list[str]:
    return ["--training.steps", str(n), *SCHEDULE]


def tb_losses(folder: Path) -> dict[int, float]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("loss/global_avg")}


def assert_ok(run) -> None:
    assert run.returncode == 0, run.output[-3000:]


def text_of_exact_tokens(n_tokens: int) -> str:
    """A prefix of a bundled play that encodes (with bos and eos) to exactly n_tokens tokens."""
    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))
    text = sorted(BUNDLED_DATASETS["shakespeare"].glob("*.txt"))[0].read_text()
    count = lambda k: len(tokenizer.encode(text[:k], bos=True, eos=True))  # noqa: E731
    lo, hi = 0, len(text)
    while lo < hi:  # the shortest prefix with at least n_tokens tokens
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < n_tokens else (lo, mid)
    assert count(lo) == n_tokens, f"no prefix encodes to exactly {n_tokens} tokens"
    return text[:lo]


@pytest.fixture(scope="module")
def periodic_data(tmp_path_factory) -> Path:
    """Two identical documents, each packing into exactly PERIOD_STEPS batches of BATCH sequences.

    With 2 data-parallel ranks each rank reads one copy; with 1 rank it reads both in turn. Either way every
    rank's stream is the same PERIOD_STEPS batches repeated, so (a) the global batch of a step has the same
    sequences on 1 and 2 ranks (twice over on 2 ranks, which leaves the mean loss and the gradient unchanged)
    and (b) restarting the data at step 10 gives the very batches a continued run reads at steps 11-20.
    """
    folder = tmp_path_factory.mktemp("periodic")
    text = text_of_exact_tokens(PERIOD_STEPS * BATCH * (SEQ + 1))
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(text)
    return folder


def data(folder: Path) -> list[str]:
    return ["--training.dataset", "text", "--training.dataset_path", str(folder)]


@pytest.fixture(scope="module")
def reference_1p(tmp_path_factory) -> dict[int, float]:
    """20 uninterrupted steps on 1 process, no checkpointing."""
    run = run_train(steps(20), tmp_path_factory.mktemp("ref1"))
    assert_ok(run)
    losses = run.tb_losses()
    assert sorted(losses) == list(range(1, 21))
    return losses


def test_one_process_resume_is_exact(tmp_path, reference_1p):
    first = run_train(steps(10) + CKPT, tmp_path)
    assert_ok(first)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-10", "step-5"]
    second = run_train(steps(20) + CKPT + RESUME_TB, tmp_path)
    assert_ok(second)
    assert f"loaded checkpoint {tmp_path / 'checkpoint' / 'step-10'}" in second.output
    resumed = tb_losses(tmp_path / "tb_resume")
    assert sorted(resumed) == list(range(11, 21))
    assert {s: reference_1p[s] for s in range(11, 21)} == resumed  # bitwise: same ops, same order

    # The same folder under a wider model: one line naming the tensor and both shapes, exit code 2, found before launch.
    wider = run_train(steps(20) + CKPT + ["--model.flavor", "debugmodel"], tmp_path)
    assert wider.returncode != 0
    errors = re.findall(r"error: .*", wider.output)
    assert errors == [f"error: checkpoint '{tmp_path / 'checkpoint' / 'step-20'}': "
                      "tensor 'model.tok_embeddings.weight' has shape [2048, 64] in the checkpoint "
                      "but [2048, 256] in this model"], wider.output[-2000:]
    assert wider.returncode == 2 and "Traceback" not in wider.output


def test_two_fsdp_processes_resume_exactly_and_on_one_process(tmp_path, periodic_data):
    reference = run_train(steps(20) + data(periodic_data), tmp_path / "ref", ngpu=2)
    assert_ok(reference)
    ref = reference.tb_losses()
    assert sorted(ref) == list(range(1, 21))

    # Asynchronous saves, keeping only the newest checkpoint.
    two = tmp_path / "two"
    async_keep1 = ["--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "1"]
    first = run_train(steps(10) + CKPT + async_keep1 + data(periodic_data), two, ngpu=2)
    assert_ok(first)
    assert sorted(p.name for p in (two / "checkpoint").iterdir()) == ["step-10"]
    # FSDP sharded it: each rank wrote its half of the weights and Adam moments (459,328 x 3 fp32 = 5.5 MB).
    shards = {f.name: f.stat().st_size for f in (two / "checkpoint" / "step-10").glob("*.distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"] and min(shards.values()) > 2_500_000, shards
    one = tmp_path / "one"
    shutil.copytree(two / "checkpoint", one / "checkpoint")

    second = run_train(steps(20) + CKPT + async_keep1 + RESUME_TB + data(periodic_data), two, ngpu=2)
    assert_ok(second)
    resumed = tb_losses(two / "tb_resume")
    assert sorted(resumed) == list(range(11, 21))
    assert {s: ref[s] for s in range(11, 21)} == resumed

    # The 2-rank FSDP checkpoint on 1 process: model, optimizer, schedule and step reshard; the data position
    # cannot, so the data restarts (periodic_data makes that the same batches) and the run says so.
    single = run_train(steps(20) + CKPT + data(periodic_data), one, ngpu=1)
    assert_ok(single)
    assert "was saved with data-parallel degree 2, this run has 1" in single.output
    assert f"loaded checkpoint {one / 'checkpoint' / 'step-10'}" in single.output
    got = single.tb_losses()
    assert sorted(got) == list(range(11, 21))
    for s in range(11, 21):
        assert abs(got[s] - ref[s]) <= 1e-6, (s, got[s], ref[s])


def start_train(overrides: list[str], dump_folder: Path, env: dict, log: Path) -> subprocess.Popen:
    full_env = {**os.environ, "CONFIG_FILE": str(BASE_TOML), "NGPU": "1", "OMP_NUM_THREADS": "1", "LOG_RANK": "0",
                **env}
    full_env.pop("DRY_RUN", None)
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(dump_folder), *overrides]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_for_stalled_save(proc: subprocess.Popen, log: Path, tmp_folder: Path, timeout: float = 300) -> int:
    """The pid of the trainer once it stalls inside the save of step 10 with its files written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"stalling the save of step 10 before its rename \(pid (\d+)\)", log.read_text())
        if m and (tmp_folder / ".metadata").is_file():
            return int(m.group(1))
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"the run never stalled in its save:\n{log.read_text()[-3000:]}")


def test_run_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, reference_1p):
    root = tmp_path / "checkpoint"
    log = tmp_path / "killed.log"
    proc = start_train(steps(20) + CKPT, tmp_path, {STALL_STEP_ENV: "10", STALL_SECONDS_ENV: "600"}, log)
    try:
        trainer_pid = wait_for_stalled_save(proc, log, root / "step-10.tmp")
        os.kill(trainer_pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert sorted(p.name for p in root.iterdir()) == ["step-10.tmp", "step-5"]

    resumed = run_train(steps(20) + CKPT + RESUME_TB, tmp_path)
    assert_ok(resumed)
    warnings = re.findall(r"WARNING skipping incomplete checkpoint '([^']+)'", resumed.output)
    assert warnings == [str(root / "step-10.tmp")]
    assert f"loaded checkpoint {root / 'step-5'}" in resumed.output
    losses = tb_losses(tmp_path / "tb_resume")
    assert sorted(losses) == list(range(6, 21))
    assert {s: reference_1p[s] for s in range(6, 21)} == losses
    assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-15", "step-20", "step-5"]
