"""Faults through ./run_train.sh as a user meets them: SIGTERM (a graceful stop on every rank), a rank killed with
SIGKILL under MAX_RESTARTS, a NaN on a chosen step, a disk that fills up during a save, a finished run extended
whose final save held the model only, a user error found inside a rank, and the launcher's own checks. In each,
the run resumes or stops as specified and no checkpoint or log of an earlier run is lost or changed."""

import hashlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.integration.harness import (
    BASE_TOML,
    CKPT,
    REPO,
    finish,
    run_train,
    start_train,
    steps,
    tb_losses,
    trainer_pids,
    wait_for_line,
)
from tests.warm_python import COLD
from titan_lite.train import NAN_STEP_ENV


def folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "error:" in line]


def assert_close(got: dict[int, float], reference: dict[int, float], wanted: range, atol: float) -> None:
    assert sorted(got) == list(wanted), got
    for s in wanted:
        assert abs(got[s] - reference[s]) <= atol, (s, got[s], reference[s])


def test_sigterm_saves_on_every_rank_exits_0_and_the_run_continues(tmp_path, reference_1p):
    """2 FSDP ranks get SIGTERM (through the launcher, as from a scheduler or Ctrl-C): both save the same step and
    the run exits 0; the same command on one process continues to step 20 with the uninterrupted losses."""
    log = tmp_path / "stopped.log"
    no_periodic_saves = ["--checkpoint.interval", "100", "--training.local_batch_size", "4"]
    proc = start_train(steps(20) + CKPT + no_periodic_saves + ["--metrics.save_tb_folder", "tb_first"], tmp_path, log,
                       ngpu=2)
    wait_for_line(proc, log, r"step:\s+3/")
    os.kill(proc.pid, signal.SIGTERM)
    assert finish(proc) == 0, log.read_text()[-3000:]
    text = log.read_text()
    stops = re.findall(r"\[rank(\d)\]:.* stopped after step (\d+) \(SIGTERM on this rank\): checkpoint step-(\d+) "
                       r"saved in", text)
    assert sorted(r for r, _, _ in stops) == ["0", "1"] and len({s for _, s, _ in stops}) == 1, text[-3000:]
    step = int(stops[0][1])
    assert 3 <= step < 20 and "Traceback" not in text
    assert folders(tmp_path / "checkpoint") == [f"step-{step}"]
    assert_close(tb_losses(tmp_path / "tb_first"), reference_1p, range(1, step + 1), atol=1e-5)

    resumed = run_train(steps(20) + CKPT + ["--metrics.save_tb_folder", "tb_resume"], tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"loaded checkpoint {tmp_path / 'checkpoint' / f'step-{step}'}" in resumed.output
    assert_close(tb_losses(tmp_path / "tb_resume"), reference_1p, range(step + 1, 21), atol=1e-5)


def test_a_killed_rank_restarts_and_a_finished_run_with_a_model_only_final_save_is_extended(tmp_path, reference_1p):
    """Run A (10 steps, final save model-only, MAX_RESTARTS=1): its rank is SIGKILLed after step 5 was saved;
    torchrun restarts it, it continues from step-5 and ends with the losses of an uninterrupted run. Run B (the same
    job with 20 steps): step-10 holds the model only, so it continues from step-5 with a note, to the uninterrupted
    losses; keep_latest_k = 1 never removes step-5, the checkpoint it resumed from."""
    root, log = tmp_path / "checkpoint", tmp_path / "killed.log"
    model_only = ["--checkpoint.last_save_model_only", "true"]
    proc = start_train(steps(10) + CKPT + model_only, tmp_path, log, env={"MAX_RESTARTS": "1"})
    wait_for_line(proc, log, r"checkpoint step 5 saved")
    (rank,) = trainer_pids(proc.pid)
    os.kill(rank, signal.SIGKILL)
    assert finish(proc) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"loaded checkpoint {root / 'step-5'}" in text  # the restarted attempt resumed
    assert "training finished after 10 steps" in text
    losses = tb_losses(tmp_path / "tb")
    assert losses[10] == reference_1p[10]  # fp32 on CPU: the same operations in the same order, bit for bit
    assert_close(losses, reference_1p, range(1, 11), atol=0)
    assert folders(root) == ["step-10", "step-5"]
    step_5 = digest(root / "step-5")

    extended = run_train(steps(20) + CKPT + model_only + ["--checkpoint.keep_latest_k", "1",
                                                          "--metrics.save_tb_folder", "tb_resume"], tmp_path)
    assert extended.returncode == 0, extended.output[-3000:]
    assert (f"WARNING '{root / 'step-10'}' holds model weights only (a final save with "
            f"'checkpoint.last_save_model_only' = true), so the run continues from '{root / 'step-5'}', its newest "
            "checkpoint with the training state: steps 6-10 run again") in extended.output
    assert f"loaded checkpoint {root / 'step-5'}" in extended.output
    assert_close(tb_losses(tmp_path / "tb_resume"), reference_1p, range(6, 21), atol=0)
    assert folders(root) == ["step-20", "step-5"] and digest(root / "step-5") == step_5


def test_nan_stops_then_skip_continues_until_the_disk_fills_up_with_checkpoints_intact(tmp_path):
    root = tmp_path / "checkpoint"
    six_steps = steps(6) + CKPT + ["--checkpoint.interval", "2"]

    # 1. The gradients of step 3 become NaN; the default policy stops before the optimizer step.
    nan = run_train(six_steps + ["--metrics.save_tb_folder", "tb1"], tmp_path, env={NAN_STEP_ENV: "3"})
    assert nan.returncode == 3, nan.output[-3000:]
    assert error_lines(nan.output) == [
        f"error: step 3: the gradient norm is nan; stopped before the optimizer step ('training.on_nonfinite' = "
        f"'stop'), so no checkpoint holds it; the newest complete checkpoint is '{root / 'step-2'}'; lower "
        f"'optimizer.lr' or set 'training.on_nonfinite' = 'skip' to skip such steps"]
    assert "Traceback" not in nan.output
    assert folders(root) == ["step-2"] and sorted(tb_losses(tmp_path / "tb1")) == [1, 2]
    step_2 = digest(root / "step-2")

    # 2. Continued with on_nonfinite = skip: step 3 is skipped, step 4 trains, and its save meets a full disk (no file
    # may grow past 1 MB): one line, its unfinished folder removed, step-2 untouched.
    full = run_train(six_steps + ["--metrics.save_tb_folder", "tb2", "--training.on_nonfinite", "skip"], tmp_path,
                     env={NAN_STEP_ENV: "3"}, max_file_bytes=1_000_000)
    assert f"loaded checkpoint {root / 'step-2'}" in full.output
    assert "WARNING step 3: the gradient norm is nan: step skipped ('training.on_nonfinite' = 'skip')" in full.output
    assert full.returncode == 3, full.output[-3000:]
    (line,) = error_lines(full.output)
    assert re.fullmatch(rf"error: checkpoint step 4 could not be written to '{root / 'step-4.tmp'}' \([\d.]+ GiB free "
                        rf"there\): (OSError: \[Errno 27\] File too large|a write stopped short, as on a full disk "
                        rf"\(.*unexpected pos.*\)); the newest complete checkpoint is '{root / 'step-2'}'", line), line
    assert "Traceback" not in full.output
    assert folders(root) == ["step-2"] and digest(root / "step-2") == step_2
    assert sorted(tb_losses(tmp_path / "tb2")) == [3, 4]
    dcp_to_torch_save(root / "step-2", tmp_path / "step-2.pt")
    weights = torch.load(tmp_path / "step-2.pt", weights_only=False)["model"]
    assert len(weights) == 39 and all(torch.isfinite(w).all() for w in weights.values())


def test_a_user_error_inside_a_rank_is_one_line_and_not_restarted(tmp_path):
    """A malformed line deep in the data is found by the ranks while training: one line from the launcher, exit 2,
    no traceback from titan_lite or torchrun, and no futile restart although MAX_RESTARTS allows two."""
    text = (REPO / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text()
    lines = [f'{{"text": "{" ".join(text[i * 600:(i + 1) * 600].split())}"}}' for i in range(8)]
    lines.insert(6, '{"text": broken')
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    run = run_train(["--training.steps", "20", "--training.dataset", "jsonl", "--training.dataset_path", str(data),
                     "--training.local_batch_size", "4"], tmp_path / "out", env={"MAX_RESTARTS": "2"})
    assert run.returncode == 2, run.output[-3000:]
    assert error_lines(run.output) == [f'error: {data}:7: not valid JSON; each line must be an object with a "text" '
                                       'string']
    assert "Traceback" not in run.output
    assert len(re.findall(r"\[rank0\]:.* training 20 steps from step 0", run.output)) == 1  # no restart


def without_permission_override() -> tuple[str, ...]:
    """root ignores file permissions; without CAP_DAC_OVERRIDE it meets them like any user."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be tested")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


def test_config_file_option_unreadable_tokenizer_and_output_folder_without_permission(tmp_path):
    """--job.config_file alone is the config (its unreadable tokenizer is what is refused); with a different
    CONFIG_FILE it is refused; an output folder without write permission is one line."""
    assets = tmp_path / "assets"
    assets.mkdir()
    shutil.copy(REPO / "assets" / "tokenizer" / "tokenizer.model", assets / "tokenizer.model")
    (assets / "tokenizer.model").chmod(0o000)
    other = tmp_path / "other.toml"
    other.write_text(BASE_TOML.read_text().replace('hf_assets_path = "./assets/tokenizer"',
                                                   f'hf_assets_path = "{assets}"'))
    env = {**os.environ, "NGPU": "1", **COLD}  # cold: setpriv's limits reach the trainer only in its own process
    env.pop("CONFIG_FILE", None)
    prefix = without_permission_override()

    def launch(dump_folder: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, str(REPO / "run_train.sh"), "--job.dump_folder", str(dump_folder), *args],
                              cwd=REPO, env={**env, **extra_env}, capture_output=True, text=True, timeout=300)

    honoured = launch(tmp_path / "out", "--job.config_file", str(other))
    assert (honoured.returncode, honoured.stderr.strip()) == (
        2, f"error: tokenizer file '{assets / 'tokenizer.model'}' cannot be read (Permission denied)")
    both = launch(tmp_path / "out", "--job.config_file", str(other), CONFIG_FILE=str(BASE_TOML))
    assert (both.returncode, both.stderr.strip()) == (
        2, f"error: CONFIG_FILE={BASE_TOML} and --job.config_file {other} name different configs; give one")

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    denied = launch(read_only, CONFIG_FILE=str(BASE_TOML))
    assert (denied.returncode, denied.stderr.strip()) == (
        2, f"error: 'job.dump_folder': cannot write to '{read_only}' (Permission denied)")
    assert "Traceback" not in honoured.stdout + both.stdout + denied.stdout
