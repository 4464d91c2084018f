"""The foundation as a user runs it: ./run_train.sh on the bundled debug config, DRY_RUN, and bad input."""

import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import REPO, run_train
from tests.test_config import APPENDIX

DEBUG_TOML = REPO / "train_configs" / "debug_model.toml"


def test_debug_config_trains_and_loss_drops(tmp_path):
    """The README's first command (Quick start), the bundled debug model on the bundled corpus, cut from 60 steps to
    12 with a 2-step validation every 6 (the suite's time: the 60 steps take two minutes on one thread). Measured:
    8.06 at step 1, 6.27 at step 12; validation 7.10, then 6.58."""
    run = run_train(["--training.steps", "12", "--validation.freq", "6", "--validation.steps", "2"], tmp_path,
                    config=DEBUG_TOML)
    assert run.returncode == 0, run.output[-3000:]  # one thread: the suite runs a test per core
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    losses = {e.step: e.value for e in acc.Scalars("loss/global_avg")}
    assert max(losses) == 12 and losses[1] > 7.0
    assert losses[12] <= 0.8 * losses[1], losses  # at least a 20% drop
    for tag in ("grad_norm", "lr", "throughput/tps", "throughput/mfu_pct", "memory/max_active_gib", "validation/loss"):
        assert acc.Scalars(tag), tag
    assert run.printed_losses[12] == pytest.approx(losses[12], abs=1e-4)
    val = [e.value for e in acc.Scalars("validation/loss")]
    assert len(val) == 2 and val[-1] < val[0]


def c4_shard(folder: Path) -> Path:
    path = folder / "c4-train.00000-of-01024.json.gz"
    with gzip.open(path, "wt") as fh:
        for i in range(20):
            doc = {"text": f"Document {i}: the quick brown fox jumps over the lazy dog.", "url": "x"}
            fh.write(json.dumps(doc) + "\n")
    return path


def test_dry_run_of_the_appendix_config(tmp_path):
    config = tmp_path / "llama3_8b.toml"
    config.write_text(APPENDIX)
    env = {**os.environ, "DRY_RUN": "1", "NGPU": "4", "CONFIG_FILE": str(config)}
    out = subprocess.run([str(REPO / "run_train.sh"), "--model.hf_assets_path", str(REPO / "assets" / "tokenizer"),
                          "--training.dataset_path", str(c4_shard(tmp_path)), "--job.dump_folder", str(tmp_path / "o")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "dp_shard 4" in text and "world 4" in text
    assert "8,030,261,248 parameters" in text
    assert "local 2 x data-parallel 4 x accumulation 1 = global 8 sequences x 512 tokens" in text
    assert not (tmp_path / "o" / "tb").exists()  # nothing trained


@pytest.mark.parametrize("args, message", [
    (["--training.stpes", "3"], "error: unknown option '--training.stpes' (did you mean 'training.steps'?)"),
    (["--training.steps", "ten"], "error: --training.steps: expected an integer, got 'ten'"),
    (["--training.steps", "-3"], "error: 'training.steps' must be at least 1, got -3"),
    (["--training.dataset", "c4"], "error: dataset 'c4' needs 'training.dataset_path'"),
])
def test_bad_input_gets_one_line(tmp_path, args, message):
    run = run_train(args + ["--training.steps", "1"] * 0, tmp_path, config=DEBUG_TOML)
    assert run.returncode != 0
    assert "Traceback" not in run.output, run.output
    error_lines = [line for line in run.output.splitlines() if "error:" in line]
    assert error_lines and message.split("error: ")[1][:40] in error_lines[0], run.output


def test_logged_lr_is_the_lr_each_step_used_and_traces_are_written(tmp_path):
    run = run_train(["--profiling.enable_profiling", "--profiling.profile_freq", "2",
                     "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1"], tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    lrs = {e.step: e.value for e in acc.Scalars("lr")}
    # base.toml: lr 1e-2, warmup 2 -> 1/3, 2/3 of the peak; then linear decay over the 3 remaining steps
    expected = {1: 1 / 3, 2: 2 / 3, 3: 2 / 3, 4: 1 / 3, 5: 0.0}
    assert lrs == pytest.approx({k: v * 1e-2 for k, v in expected.items()}, abs=1e-9)
    for step in (2, 4):
        trace = tmp_path / "profile_trace" / f"iteration_{step}" / "rank0_trace.json"
        assert "aten::mm" in trace.read_text() and json.loads(trace.read_text())["traceEvents"]
