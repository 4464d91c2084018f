"""The run folder records the run (the resolved config as TOML, the log as a file) and surprises become lines: a
warmup longer than the run, a re-run whose checkpoint is already at training.steps."""

import pytest

from titan_lite.config import parse_args

from .harness import ANSI_COLOUR, run_train


@pytest.mark.slow  # two runs: about 25 s on 2 busy cores
def test_run_folder_holds_config_and_log_and_a_rerun_says_it_is_done(tmp_path):
    out = tmp_path / "run"
    args = ["--training.steps", "3", "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "1",
            "--checkpoint.enable", "--checkpoint.interval", "3"]
    first = run_train(args, out)
    assert first.returncode == 0, first.output[-3000:]
    assert sorted(first.printed_losses) == [1, 2, 3]

    log = (out / "train.log").read_text()
    assert ANSI_COLOUR.search(log) is None
    assert "'lr_scheduler.warmup_steps' = 10 is longer than the run ('training.steps' = 3)" in log
    step_lines = [line for line in log.splitlines() if " step:  3/3  loss:" in line]
    assert len(step_lines) == 1 and step_lines[0].endswith("eta: 0s"), log[-2000:]
    assert "saving checkpoint step 3 to" in log
    resolved = parse_args(["--job.config_file", str(out / "config.toml")])
    assert (resolved.training.steps, resolved.lr_scheduler.warmup_steps, resolved.job.dump_folder) == (3, 10, str(out))

    again = run_train(args, out)
    assert again.returncode == 0, again.output[-3000:]
    assert "the run is already at 'training.steps' = 3: checkpoint step-3" in again.output
    assert again.printed_losses == {}
    assert (out / "train.log").read_text().startswith(log)  # the resumed run appends


@pytest.mark.slow  # two one-step runs: about 20 s
def test_exports_are_written_only_by_a_run_that_checkpoints_and_asks_for_them(tmp_path):
    """checkpoint.enable = false writes nothing, as torchtitan: the HF export and the PEFT adapter it asks for are
    one warning at the start and one line at the end. Checkpointing on without last_save_in_hf: the checkpoint only,
    no adapter and no base."""
    lora = ["--training.steps", "1", "--model.converters", "lora"]
    off = run_train([*lora, "--checkpoint.last_save_in_hf"], tmp_path / "off")
    assert off.returncode == 0, off.output[-3000:]
    assert ("'checkpoint.last_save_in_hf' = True has no effect: it takes effect only with 'checkpoint.enable' = "
            "true, and that is false; set --checkpoint.enable or drop the setting") in off.output
    assert "nothing written at the end: 'checkpoint.enable' is false" in off.output
    assert not (tmp_path / "off" / "checkpoint").exists()

    on = run_train([*lora, "--checkpoint.enable"], tmp_path / "on")
    assert on.returncode == 0, on.output[-3000:]
    assert sorted(p.name for p in (tmp_path / "on" / "checkpoint").iterdir()) == ["step-1"]
