"""The GPU lane stays in working order: `python -m benchmarks.gpu --smoke` runs every case on CPU with tiny shapes,
printing a result line per case (skips named with their reason) and writing its report; titan_lite names the oldest
torch it runs on."""

import os
import subprocess
from pathlib import Path

import pytest

import titan_lite
from tests.warm_python import python_command

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_lane_smoke_runs_every_case_on_cpu(tmp_path):
    from benchmarks.gpu import CASES

    report = tmp_path / "GPU.md"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run([*python_command(), "-m", "benchmarks.gpu", "--smoke", "--out", str(report)], cwd=REPO,
                          env=env | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert lines[-1].startswith(f"result: {len(CASES)} cases, ") and lines[-1].endswith(f"report in {report}")
    assert " 0 failed" in lines[-1]
    for name in CASES:  # every case printed at least one line of its own
        assert any(x.startswith((f"{name}:", f"memory {name}", f"{name} ")) for x in lines) or name == "memory", name
    skips = [x for x in lines[:-1] if "skipped" in x]
    assert all("skipped: " in x and x.split("skipped: ", 1)[1] for x in skips), skips  # each with its reason
    train = next(x for x in lines if x.startswith("train_1b_eager: "))
    assert "tokens/s" in train and "peak 0.0" in train
    ratios = [float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("memory train_") and "estimate / measured" in x]
    assert ratios and all(0.85 < r < 1.15 for r in ratios)  # the CPU plan of the CPU step
    text = report.read_text()
    assert "SMOKE" in text and "torch " in text and lines[-2] in text


def test_oldest_torch_is_parsed_from_any_build_string():
    release = titan_lite._torch_release
    assert release("2.11.0+cu130") == (2, 11) and release("2.12.0a0+git1234") == (2, 12)
    assert release("2.8.0") < titan_lite.MIN_TORCH <= release("2.9.0")


def test_gpu_lane_without_cuda_or_smoke_is_one_line():
    proc = subprocess.run([*python_command(), "-m", "benchmarks.gpu", "--cases", "nope"], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: unknown case(s) nope; known: correctness")
