"""The benchmark entry point runs a case end to end and writes its JSON; the CPU allocator setting applies once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from titan_lite.distributed import keep_freed_memory

REPO = Path(__file__).resolve().parents[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the rendezvous an in-process trainer of an earlier test left in it."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    return env | {"PYTHONPATH": str(REPO)} | extra


def test_benchmark_runs_a_tiny_case_and_writes_json(tmp_path):
    out = tmp_path / "results.json"
    env = clean_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--cases", "tiny,wanda_tiny", "--repeats", "1",
                           "--steps", "1", "--warmup", "0", "--retries", "0", "--threads", "1", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("result: ")
    assert "load average" in proc.stdout
    results = json.loads(out.read_text())
    tiny, wanda = results["cases"]
    full, lora = tiny["variants"]
    run = full["runs"][0]
    assert full["label"] == "titan_lite" and run["tokens_per_s"] > 0 and run["peak_rss_gib"] > 0
    assert results["matmul_peak_gflops"] > 0 and 0 < run["mfu_pct"]
    assert lora["runs"][0]["step_s"] > 0 and tiny["ratios"][0]["label"] == "LoRA / full step time"
    (pruned,) = wanda["variants"]
    assert pruned["runs"][0]["prune_s"] > 0 and pruned["runs"][0]["floor_s"] > 0
    (ratio,) = wanda["ratios"]
    assert ratio["value"] == pruned["median"]["prune_s"] / pruned["median"]["floor_s"] and ratio["target"] == 2.0
    assert "tiny LoRA / full step time" in proc.stdout.strip().splitlines()[-1]


def test_keep_freed_memory_only_on_cpu(monkeypatch):
    assert not keep_freed_memory(torch.device("meta"))
    monkeypatch.setenv("TITAN_LITE_CPU_MALLOC", "default")
    assert not keep_freed_memory(torch.device("cpu"))


def test_worker_batch_option_sets_the_sequences_per_rank():
    """The FSDP cases compare one global batch in 1 and 2 processes: the worker trains the batch it is given."""
    env = clean_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", "--impl", "titan_lite", "--shape", "tiny",
                           "--batch", "3", "--steps", "1", "--warmup", "0", "--tensor_peak"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
    result = json.loads(line.split(" ", 1)[1])
    assert result["tokens_per_step"] == 3 * 32 and result["peak_tensor_bytes"] > 0


def test_paired_worker_alternates_both_steps_in_one_process():
    """--impl paired times titan_lite's and transformers' steps in turn in one process and states the ratio."""
    env = clean_env(OMP_NUM_THREADS="1", TITAN_LITE_CPU_MALLOC="default")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", "--impl", "paired", "--shape", "tiny",
                           "--steps", "3", "--warmup", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (summary,) = [x for x in proc.stdout.splitlines() if x.startswith("paired in one process")]
    assert "glibc's default allocator" in summary and summary.endswith("x")
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
    result = json.loads(line.split(" ", 1)[1])
    assert len(result["step_s"]) == len(result["transformers_step_s"]) == 3
    ratio = float(summary.rsplit(": ", 1)[1].rstrip("x"))
    expected = sorted(result["transformers_step_s"])[1] / sorted(result["step_s"])[1]
    assert abs(ratio - expected) < 0.006
