"""Faults in one process: stop signals, the non-finite policy on a real trainer, a hung collective on gloo (2 ranks)
and the launcher's rank-side protocol."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.hang_worker import one_rank_hangs
from tests.helpers import spawn_gloo
from titan_lite import faults
from titan_lite.config import parse_args
from titan_lite.errors import HANG, TrainingFault
from titan_lite.faults import StopSignals, nonfinite_message
from titan_lite.launcher import LAUNCH_DIR_ENV, read_error, register_rank, report_error
from titan_lite.train import NAN_STEP_ENV, Trainer, one_line_error

# ------------------------------------------------------------------------------------------ stop signals


def test_first_signal_asks_to_stop_a_copy_is_ignored_a_second_exits_at_once(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: clock[0])
    exits = []
    stop = StopSignals(exit_now=exits.append)
    assert not stop.requested
    stop.handle(signal.SIGTERM)
    assert stop.requested and stop.name == "SIGTERM" and exits == []
    clock[0] += 0.5  # the same request delivered again (a scheduler signals every process, the launcher forwards)
    stop.handle(signal.SIGTERM)
    assert exits == []
    clock[0] += 1.0
    stop.handle(signal.SIGINT)
    assert exits == [128 + signal.SIGINT]


def test_handlers_are_installed_only_while_training():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals().installed() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # Python runs the handler at the next bytecode boundary
        assert stop.requested and stop.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_nonfinite_message_names_the_step_and_the_value():
    assert nonfinite_message(3, 2.5, 0.7) is None
    assert nonfinite_message(3, float("nan"), 0.7) == "step 3: the loss is nan"
    assert nonfinite_message(9, 2.5, float("inf")) == "step 9: the gradient norm is inf"
    assert nonfinite_message(4, float("nan"), float("nan")) == "step 4: the loss is nan and the gradient norm is nan"


# ------------------------------------------------------------------------------------------ non-finite policy


@pytest.fixture(scope="module")
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def trainer_with(tmp_path, policy: str) -> Trainer:
    cfg = parse_args(["--job.config_file", "tests/integration/base.toml", "--job.dump_folder", str(tmp_path),
                      "--training.seq_len", "32", "--metrics.enable_tensorboard=false",
                      "--training.on_nonfinite", policy])
    return Trainer(cfg)


def parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model_parts[0].named_parameters()}


def adam_steps(trainer: Trainer) -> int:
    return int(next(iter(trainer.optimizer.state.values()))["step"])


def test_skip_applies_no_update_and_moves_the_schedule_and_data_on(tmp_path, monkeypatch, single_process_group,
                                                                   capsys):
    monkeypatch.setenv(NAN_STEP_ENV, "2")
    trainer = trainer_with(tmp_path, "skip")
    data = iter(trainer.dataloader)
    after = [parameters(trainer)]
    for step in (1, 2, 3):
        trainer.train_state.step = step
        trainer.run_step(step, data)
        after.append(parameters(trainer))
    assert all(torch.equal(after[2][n], after[1][n]) for n in after[1])  # step 2: no update
    assert not all(torch.equal(after[1][n], after[0][n]) for n in after[0])
    assert not all(torch.equal(after[3][n], after[2][n]) for n in after[2])
    assert adam_steps(trainer) == 2  # the optimizer stepped on steps 1 and 3 only
    assert trainer.lr_schedule.step_count == 3 and trainer.dataloader.microbatches == 3
    warnings = [line.split(" WARNING ", 1)[1] for line in capsys.readouterr().out.splitlines() if " WARNING " in line]
    assert warnings == ["step 2: the gradient norm is nan: step skipped ('training.on_nonfinite' = 'skip'): no update "
                        "is applied; the LR schedule and the data move on"]
    assert all(torch.isfinite(p).all() for p in after[3].values())


def test_stop_raises_naming_the_step_before_anything_changes(tmp_path, monkeypatch, single_process_group):
    monkeypatch.setenv(NAN_STEP_ENV, "2")
    trainer = trainer_with(tmp_path, "stop")
    data = iter(trainer.dataloader)
    trainer.run_step(1, data)
    before = parameters(trainer)
    with pytest.raises(TrainingFault) as err:
        trainer.run_step(2, data)
    assert str(err.value) == ("step 2: the gradient norm is nan; stopped before the optimizer step "
                              "('training.on_nonfinite' = 'stop'), so no checkpoint holds it; no checkpoint of this "
                              "run exists yet; lower 'optimizer.lr' or set 'training.on_nonfinite' = 'skip' to skip "
                              "such steps")
    assert all(torch.equal(p, before[n]) for n, p in parameters(trainer).items())
    assert adam_steps(trainer) == 1


# ------------------------------------------------------------------------------------------ a hung collective


def test_a_hung_collective_times_out_and_names_the_rank_and_the_operation(tmp_path):
    """The line the trainer's entry point prints (one_line_error maps such an exception to it, exit 4)."""
    result = tmp_path / "result.json"
    spawn_gloo(one_rank_hangs, 2, str(result))
    code, line = json.loads(result.read_text())
    assert code == HANG
    assert line.startswith("rank 0 of 2 timed out after 2 s ('comm.train_timeout_seconds') in a collective while in "
                           "step 7 (forward, backward, gradient reductions): another rank did not join (stuck or "
                           "dead: see its log); backend: "), line
    assert "Timed out waiting 2000ms" in line and "\n" not in line


# ------------------------------------------------------------------------------------------ launcher protocol


def test_a_rank_reports_its_error_to_the_launcher_or_prints_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(LAUNCH_DIR_ENV, raising=False)
    report_error(2, "'training.steps' must be at least 1, got 0")
    assert capsys.readouterr().err == "error: 'training.steps' must be at least 1, got 0\n"

    monkeypatch.setenv(LAUNCH_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    report_error(3, "step 5: the loss is nan")
    assert capsys.readouterr().err == ""
    error = read_error(tmp_path / "rank3.error")
    assert (error.rank, error.code, error.message) == (3, 3, "step 5: the loss is nan")
    register_rank()  # a restarted rank forgets its previous attempt's error
    assert not (tmp_path / "rank3.error").exists()
    assert (tmp_path / "rank3.pid").read_text() == str(os.getpid())


def test_the_entry_point_maps_errors_to_one_line_and_an_exit_code(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    code, line = one_line_error(RuntimeError("[pair.cc:78] Timed out waiting 100000ms for recv operation"))
    assert code == HANG and line.startswith("rank 5 of 8 timed out")
    assert one_line_error(TrainingFault("step 3: the loss is nan")) == (3, "step 3: the loss is nan")
    assert one_line_error(ValueError("a bug")) is None  # its traceback is printed


def launch_local(ranks: int, log_ranks: str, script: str) -> subprocess.CompletedProcess:
    """python -m titan_lite.launcher --local ranks --log-ranks log_ranks -c script (no torch: a second or so)."""
    env = {k: v for k, v in os.environ.items() if k != LAUNCH_DIR_ENV}
    return subprocess.run([sys.executable, "-m", "titan_lite.launcher", "--local", str(ranks), "--log-ranks",
                           log_ranks, "-c", script], capture_output=True, text=True, timeout=60, env=env)


def test_local_ranks_get_torchruns_environment_and_only_the_shown_ranks_output():
    out = launch_local(3, "0,2", "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], "
                                 "os.environ['LOCAL_RANK'], os.environ['MASTER_ADDR'])")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank0]:0 3 0 127.0.0.1", "[rank2]:2 3 2 127.0.0.1"]


def test_a_local_rank_that_crashes_stops_the_others_and_its_hidden_last_lines_are_shown():
    """Rank 1 (not shown) raises; rank 0 would sleep for a minute: it is stopped after the grace period."""
    script = ("import os, time\nif os.environ['RANK'] == '1':\n    raise ValueError('a bug in rank 1')\n"
              "time.sleep(60)")
    started = time.monotonic()
    out = launch_local(2, "0", script)
    assert time.monotonic() - started < 30
    assert out.returncode == 1
    assert "[rank1]:ValueError: a bug in rank 1" in out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("error: rank 1 exited with code 1 (its last lines are above); the "
                                                   "other ranks were stopped")


def test_several_local_ranks_meet_at_rank_0s_store_on_an_ephemeral_port():
    script = ("import datetime, torch.distributed as dist\nfrom titan_lite import distributed as d\n"
              "d.init_process_group(__import__('torch').device('cpu'), 60)\n"
              "t = __import__('torch').tensor([dist.get_rank() + 1.0]); dist.all_reduce(t); print(int(t.item()))\n"
              "dist.barrier(); dist.destroy_process_group()")
    out = launch_local(2, "0,1", script)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank0]:3", "[rank1]:3"]
