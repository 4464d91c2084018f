"""Exact resume through ./run_train.sh: 1 process (a finished run extended with more steps), 2 FSDP processes,
2 -> 1 resharding (data position included), and a save killed midway.

Every run uses `lr_scheduler.total_steps 20` (harness.SCHEDULE), so a 10-step run follows the same LR schedule as
the first 10 steps of a 20-step run and its checkpoint can be continued to step 20.
"""

import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import CKPT, run_train, start_train, steps, tb_losses
from titan_lite.checkpoint.manager import STALL_SECONDS_ENV, STALL_STEP_ENV
from titan_lite.checkpoint.resume import holds_training_state

RESUME_TB = ["--metrics.save_tb_folder", "tb_resume"]  # the resumed run's losses, apart from the first run's


def step_times(folder: Path) -> dict[int, float]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("time/step_s")}


def assert_ok(run) -> None:
    assert run.returncode == 0, run.output[-3000:]


def test_one_process_resume_is_exact(tmp_path, reference_1p):
    """A finished 10-step run re-run with --training.steps 20 continues from its final save (which keeps the
    training state by default) exactly as if it had never stopped."""
    first = run_train(steps(10) + CKPT, tmp_path)
    assert_ok(first)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-10", "step-5"]
    assert holds_training_state(tmp_path / "checkpoint" / "step-10")
    second = run_train(steps(20) + CKPT + RESUME_TB, tmp_path)
    assert_ok(second)
    assert f"loaded checkpoint {tmp_path / 'checkpoint' / 'step-10'}" in second.output
    resumed = tb_losses(tmp_path / "tb_resume")
    assert sorted(resumed) == list(range(11, 21))
    assert {s: reference_1p[s] for s in range(11, 21)} == resumed  # bitwise: same ops, same order
    # The first line after the resume times step 11 alone (its window starts at the step resumed from, not at 0, which
    # made it 11 times too short and the ETA with it).
    before, after = step_times(tmp_path / "tb"), step_times(tmp_path / "tb_resume")
    assert after[11] >= 0.5 * statistics.median(before[s] for s in range(2, 11)), (before, after)

    # The same folder under a wider model: one line naming the tensor and both shapes, exit code 2, found before launch.
    wider = run_train(steps(20) + CKPT + ["--model.flavor", "debugmodel"], tmp_path)
    assert wider.returncode != 0
    errors = re.findall(r"error: .*", wider.output)
    assert errors == [f"error: checkpoint '{tmp_path / 'checkpoint' / 'step-20'}': "
                      "tensor 'model.tok_embeddings.weight' has shape [2048, 64] in the checkpoint "
                      "but [2048, 256] in this model"], wider.output[-2000:]
    assert wider.returncode == 2 and "Traceback" not in wider.output


def test_two_fsdp_processes_resume_exactly_and_on_one_process(tmp_path):
    """On the bundled corpus (ordinary multi-window documents), with a global batch of 8 sequences: 2 FSDP ranks,
    1 process with accumulation 2, a 2-rank resume and a 2 -> 1 resume all read the same global batches."""
    fsdp = ["--training.local_batch_size", "4"]
    reference = run_train(steps(20) + fsdp, tmp_path / "ref", ngpu=2)
    assert_ok(reference)
    ref = reference.tb_losses()
    assert sorted(ref) == list(range(1, 21))
    accumulated = run_train(steps(20) + fsdp + ["--training.global_batch_size", "8"], tmp_path / "acc", ngpu=1)
    assert_ok(accumulated)
    acc = accumulated.tb_losses()
    assert all(abs(acc[s] - ref[s]) <= 1e-5 for s in ref), (acc, ref)

    # Asynchronous saves, keeping only the newest checkpoint.
    two = tmp_path / "two"
    async_keep1 = ["--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "1"]
    first = run_train(steps(10) + CKPT + async_keep1 + fsdp, two, ngpu=2)
    assert_ok(first)
    assert sorted(p.name for p in (two / "checkpoint").iterdir()) == ["step-10"]
    # FSDP sharded it: each rank wrote its half of the weights and Adam moments (459,328 x 3 fp32 = 5.5 MB).
    shards = {f.name: f.stat().st_size for f in (two / "checkpoint" / "step-10").glob("*.distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"] and min(shards.values()) > 2_500_000, shards
    one = tmp_path / "one"
    shutil.copytree(two / "checkpoint", one / "checkpoint")

    second = run_train(steps(20) + CKPT + async_keep1 + RESUME_TB + fsdp, two, ngpu=2)
    assert_ok(second)
    resumed = tb_losses(two / "tb_resume")
    assert sorted(resumed) == list(range(11, 21))
    assert {s: ref[s] for s in range(11, 21)} == resumed

    # The 2-rank FSDP checkpoint on 1 process: model, optimizer, schedule, step and data position reshard.
    single = run_train(steps(20) + CKPT, one, ngpu=1)
    assert_ok(single)
    assert f"loaded checkpoint {one / 'checkpoint' / 'step-10'}" in single.output
    assert "restarts" not in single.output
    got = single.tb_losses()
    assert sorted(got) == list(range(11, 21))
    for s in range(11, 21):
        assert abs(got[s] - ref[s]) <= 1e-5, (s, got[s], ref[s])


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
    proc = start_train(steps(20) + CKPT, tmp_path, log, env={STALL_STEP_ENV: "10", STALL_SECONDS_ENV: "600"})
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
