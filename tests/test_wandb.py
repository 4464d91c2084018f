"""Weights & Biases logging in WANDB_MODE=offline, read back with wandb's own reader (`wandb leet inspect --json` on
the run's .wandb file): the scalars TensorBoard gets, the resolved config, torchtitan's WANDB_* variables, rank 0 or
every rank, a resumed run continuing the same run id, and a missing package as one line."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytest.importorskip("wandb")

from tests.integration.harness import CKPT, run_train, steps
from titan_lite.config import parse_args
from titan_lite.errors import ConfigError
from titan_lite.metrics.logger import MetricsProcessor
from titan_lite.metrics.wandb_writer import check_wandb_installed

CPU = torch.device("cpu")
ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "titan-lite-tests", "WANDB_TEAM": "team-x",
       "WANDB_RUN_NAME": "tiny-run", "WANDB_RUN_GROUP": "sweep-1", "WANDB_RUN_TAGS": "tiny, cpu",
       "WANDB_RUN_NOTES": "offline test", "WANDB_RUN_JOB_TYPE": "train"}


@pytest.fixture
def wandb_env(monkeypatch):
    for name in ("WANDB_RUN_ID", "WANDB_RESUME_FROM", "WANDB_FORK_FROM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


def wandb_runs(folder: Path) -> list[dict]:
    """Every offline run under folder/wandb, oldest first, as wandb's reader gives it: {"run": the run record,
    "history": {step: scalars}}."""
    runs = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(path), "--json"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.strip()]
        run = next(r["run"] for r in records if r["type"] == "run")
        history = {int(r["history"]["step"]["num"]): {k: v for k, v in r["history"]["item"].items()
                                                      if not k.startswith("_")}
                   for r in records if r["type"] == "history"}
        runs.append({"run": run, "history": history})
    return runs


def tb_scalars(folder: Path) -> dict[int, dict[str, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


def assert_same_scalars(wandb_history: dict, tensorboard: dict) -> None:
    """W&B holds every TensorBoard scalar of every step (TensorBoard stores float32)."""
    assert sorted(wandb_history) == sorted(tensorboard)
    for step, scalars in tensorboard.items():
        assert set(wandb_history[step]) == set(scalars), step
        for name, value in scalars.items():
            assert wandb_history[step][name] == pytest.approx(value, rel=1e-6, abs=1e-30), (step, name)


def config_as_json(cfg) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def test_scalars_config_and_environment_reach_the_run(tmp_path, wandb_env):
    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--metrics.enable_tensorboard", "--metrics.enable_wandb",
                      "--metrics.log_freq", "2"])
    metrics = MetricsProcessor(cfg, 0, CPU, num_flops_per_token=6e6)
    for step in range(1, 5):
        metrics.add_tokens(512)
        if metrics.should_log(step):
            metrics.log(step, loss=10.0 / step, grad_norm=step / 10, lr=step * 1e-4, extra={"custom/x": 2.0 * step})
    metrics.log_validation(4, 3.25, {"token_accuracy": 0.5})
    metrics.close()

    (run,) = wandb_runs(tmp_path / "tb")
    tensorboard = tb_scalars(tmp_path / "tb")
    assert sorted(tensorboard) == [1, 2, 4] and tensorboard[4]["validation/loss"] == 3.25
    assert tensorboard[2]["loss/global_avg"] == 5.0 and "throughput/tps" in tensorboard[2]
    assert_same_scalars(run["history"], tensorboard)
    record = run["run"]
    assert (record["project"], record["display_name"], record["run_group"], record["job_type"], record["notes"]) == \
        ("titan-lite-tests", "tiny-run", "sweep-1", "train", "offline test")
    assert record["tags"] == ["tiny", "cpu"]
    config = {k: v for k, v in record["config"]["update"].items() if k != "_wandb"}
    assert config == config_as_json(cfg)
    assert (tmp_path / "tb" / "wandb_run_id").read_text().strip() == record["run_id"]


def test_rank_0_by_default_every_rank_with_save_for_all_ranks(tmp_path, wandb_env):
    for all_ranks in (False, True):
        folder = tmp_path / str(all_ranks)
        cfg = parse_args(["--job.dump_folder", str(folder), "--metrics.enable_wandb",
                          f"--metrics.save_for_all_ranks={str(all_ranks).lower()}"])
        for rank in (0, 1):
            metrics = MetricsProcessor(cfg, rank, CPU, 1.0)
            metrics.log(1, loss=float(rank + 1), grad_norm=0.0, lr=0.0)
            metrics.close()
        if not all_ranks:
            (run,) = wandb_runs(folder / "tb")
            assert run["history"][1]["loss/global_avg"] == 1.0
            assert not (folder / "tb" / "events.out.tfevents").exists()  # W&B alone writes no TensorBoard
        else:
            ranks = [wandb_runs(folder / "tb" / f"rank_{rank}") for rank in (0, 1)]
            assert [runs[0]["history"][1]["loss/global_avg"] for runs in ranks] == [1.0, 2.0]
            assert ranks[0][0]["run"]["run_id"] != ranks[1][0]["run"]["run_id"]


def test_missing_wandb_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = parse_args(["--metrics.enable_wandb"])
    with pytest.raises(ConfigError) as exc:
        check_wandb_installed(cfg)
    message = str(exc.value)
    assert message.startswith("'metrics.enable_wandb' needs the wandb package, which is not installed: ")
    assert message.endswith("[wandb]'") and "pip install" in message and "\n" not in message
    check_wandb_installed(parse_args([]))  # off: never imported


@pytest.mark.slow
def test_training_and_its_resume_log_one_wandb_run(tmp_path):
    """run_train.sh with TensorBoard and W&B: 4 steps, then the same command for 6 resumes from step 4's checkpoint
    and continues the same W&B run id; each attempt's W&B history equals its TensorBoard scalars."""
    env = {**ENV}
    dump = tmp_path / "run"
    first = run_train([*steps(4), *CKPT, "--metrics.enable_wandb"], dump, env=env)
    assert first.returncode == 0, first.output[-3000:]
    tensorboard_first = tb_scalars(dump / "tb")
    second = run_train([*steps(6), *CKPT, "--metrics.enable_wandb"], dump, env=env)
    assert second.returncode == 0, second.output[-3000:]
    assert "resuming after step 4" in second.output

    runs = wandb_runs(dump / "tb")
    assert len(runs) == 2 and runs[0]["run"]["run_id"] == runs[1]["run"]["run_id"]
    assert sorted(runs[0]["history"]) == [1, 2, 3, 4] and sorted(runs[1]["history"]) == [5, 6]
    assert_same_scalars(runs[0]["history"], tensorboard_first)
    tensorboard_all = tb_scalars(dump / "tb")
    assert_same_scalars(runs[1]["history"], {s: v for s, v in tensorboard_all.items() if s > 4})
    assert [runs[i]["run"]["config"]["update"]["training"]["steps"] for i in (0, 1)] == [4, 6]
    assert {s: h["loss/global_avg"] for s, h in runs[1]["history"].items()} == \
        pytest.approx({s: second.printed_losses[s] for s in (5, 6)}, abs=5e-5)


def test_an_unknown_wandb_mode_is_one_line_before_any_login(monkeypatch):
    """WANDB_MODE=bogus is named as a mode W&B does not have (wandb.init would ask to log in instead)."""
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ConfigError) as exc:
        check_wandb_installed(parse_args(["--metrics.enable_wandb"]))
    assert str(exc.value) == ("'metrics.enable_wandb': WANDB_MODE='bogus' is not a W&B mode; expected online (the "
                              "default), offline (no account needed) or disabled (also shared, dryrun, run)")
