"""The benchmark entry point runs a case end to end and writes its JSON; the CPU allocator setting applies once."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.cases import CASES
from benchmarks.framework import RunOutput
from benchmarks.kernel_floor import floor_summary, record_step
from benchmarks.shapes import SHAPES
from benchmarks.worker import RESULT_PREFIX
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
    # Both implementations run the same model: the same matmuls (2*M*N*K summed) and attention calls per step.
    ours, theirs = result["kernel_floor"]["titan_lite"], result["kernel_floor"]["transformers"]
    assert ours["matmul_gflops"] == pytest.approx(theirs["matmul_gflops"], rel=1e-6) and ours["matmul_gflops"] > 0
    assert ours["attention_calls"] == theirs["attention_calls"] == 2 * SHAPES["tiny"].args().n_layers
    assert all(0 < f["floor_s"] == pytest.approx(f["matmul_s"] + f["attention_s"]) for f in (ours, theirs))
    bound = [x for x in proc.stdout.splitlines() if x.startswith("the most a step running these kernels")]
    assert bound and bound[0].split(": ")[1].startswith(f"{expected_bound(result):.2f}x")


def expected_bound(result: dict) -> float:
    floors = result["kernel_floor"]
    return sorted(result["transformers_step_s"])[1] / min(f["floor_s"] for f in floors.values())


def test_kernel_floor_replays_exactly_the_recorded_matmuls_and_attention():
    """record_step keeps the forward and backward matmul and attention calls of a step, with their FLOPs."""
    x = torch.randn(2, 4, 8, 16, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)

    def step():
        q = x @ w[:, :16]  # bmm-free: a 4-D @ 2-D matmul folds into one mm
        out = torch.nn.functional.scaled_dot_product_attention(q, x, x, is_causal=True)
        out.sum().backward()
    calls = record_step(step)
    # forward: 1 mm (64x16 @ 16x16); backward: the gradients of both of its inputs, 2 mm of the same size
    assert calls.count("matmul") == 3 and calls.matmul_flops == 3 * 2 * 64 * 16 * 16
    assert calls.count("attention") == 2  # the flash forward and its backward
    floor = floor_summary(calls, [calls.replay_seconds("matmul")], [calls.replay_seconds("attention")])
    assert floor["matmul_calls"] == 3 and floor["floor_s"] > 0


def test_paired_case_reads_the_in_process_ratio_and_the_kernel_floor_from_one_run():
    case = CASES["paired_debug"]()
    (variant,) = case.variants
    result = {"step_s": [1.0, 2.0, 3.0], "transformers_step_s": [2.0, 2.4, 9.0], "own_cpu_s": 10.0, "wall_s": 5.0,
              "machine_busy_s": 10.5, "peak_rss_bytes": 2**30,
              "kernel_floor": {"titan_lite": {"floor_s": 1.6}, "transformers": {"floor_s": 1.5}}}
    out = RunOutput(RESULT_PREFIX + json.dumps(result) + "\n", 0, 5.0, 10.0, 2**30)
    m = variant.metrics(out)
    assert (m["step_s"], m["transformers_step_s"], m["kernel_floor_s"]) == (2.0, 2.4, 1.5)
    assert m["foreign_cores"] == pytest.approx(0.1) and m["step_spread"] == 3.0
    assert case.max_rounds == 1 and [r.metric for r in case.ratios] == ["transformers_step_s", "step_s",
                                                                         "transformers_step_s"]


def test_floor_worker_prints_a_lora_steps_kernel_floor():
    """--impl floor alternates titan_lite's (here LoRA) steps with replays of their kernel floor."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", "--impl", "floor", "--shape", "tiny",
                           "--steps", "2", "--warmup", "1", "--lora", "--lora.rank 4"],
                          cwd=REPO, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("kernel floor of titan_lite's LoRA step")]
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)][0].split(" ", 1)[1])
    floor = result["kernel_floor"]
    # per adapted projection: 2 forward matmuls of the adapter beside the frozen one's
    assert floor["matmul_calls"] > 7 * SHAPES["tiny"].args().n_layers * 3 and len(result["step_s"]) == 2
    assert line.endswith(f"{statistics.median(result['step_s']) / floor['floor_s']:.2f}x its floor")


def test_distill_worker_alternates_plain_and_distilled_steps_and_the_teachers_forward():
    """--impl distill: one trainer with a teacher, its objective switched per step; the case reads the teacher's cost
    in a step (distilled - plain) against its forward alone."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", "--impl", "distill", "--shape", "tiny",
                           "--steps", "2", "--warmup", "1"],
                          cwd=REPO, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    case = CASES["distill_tiny"]()
    (variant,) = case.variants
    m = variant.metrics(RunOutput(proc.stdout, 0, 1.0, 1.0, 2**30))
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)][0].split(" ", 1)[1])
    assert [len(result[k]) for k in ("step_s", "distill_step_s", "teacher_forward_s")] == [2, 2, 2]
    assert result["teacher_flavor"] == "tiny" and m["teacher_forward_s"] > 0
    assert m["teacher_cost_s"] == pytest.approx(m["distill_step_s"] - m["step_s"])
    assert [r.denominator_metric for r in case.ratios] == ["step_s", "teacher_forward_s", "step_s"]


def test_chat_packing_case_reads_trained_tokens_and_sets_the_mask_target():
    case = CASES["chat_packing"]()
    packed, causal, padded = case.variants
    assert [v.layout for v in case.variants] == ["packed", "packed_causal", "padded"]
    mask_cost = case.ratios[1]
    assert (mask_cost.numerator, mask_cost.denominator, mask_cost.target) == (packed.label, causal.label, 1.10)
    result = {"step_s": [2.0, 4.0], "trained_per_step": [300, 300], "total_per_step": [1000, 1000],
              "real_per_step": [800, 700], "peak_rss_bytes": 2**30, "machine_busy_s": None, "own_cpu_s": 6.0,
              "wall_s": 6.0, "flops_per_token": 1e6}
    metrics = packed.metrics(RunOutput(RESULT_PREFIX + json.dumps(result), 0, 6.0, 6.0, 2**30))
    assert metrics["trained_tokens_per_s"] == 100 and metrics["tokens_per_s"] == 2000 / 6
    assert metrics["trained_pct"] == 30 and metrics["real_pct"] == 75 and metrics["step_s"] == 3.0


ENTRY_POINTS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
                      if 'if __name__ == "__main__":' in p.read_text())


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_benchmarks_help_states_its_whole_first_paragraph(name, monkeypatch, capsys):
    """--help's description is the docstring's first paragraph, whole: never cut mid-sentence at a line break."""
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0
    first = " ".join(module.__doc__.strip().split("\n\n")[0].split())
    assert first.rstrip().endswith((".", ":", ")")), name
    assert "".join(first.split()) in "".join(capsys.readouterr().out.split()), name  # argparse wraps at hyphens


def test_every_cases_columns_have_a_table_label():
    """The table run.py prints names each column of every case (a case whose column has no label fails only after
    all of its runs, at the table)."""
    from benchmarks.run import _LABELS

    missing = {name: [c for c in build().columns if c not in _LABELS] for name, build in CASES.items()}
    assert {name: cols for name, cols in missing.items() if cols} == {}


def test_a_run_without_training_cases_prints_no_nan_peak():
    """The matmul peak is measured only for cases that train (MFU): without one the table says so."""
    from benchmarks.run import table

    assert table([], None).splitlines()[0] == ("fp32 matmul peak: not measured (no case here trains; it is what MFU "
                                               "is measured against)")
    assert table([], 123.45).splitlines()[0] == "fp32 matmul peak (median): 123.5 GFLOP/s"


def test_data_loading_smoke_prints_every_figure(monkeypatch, capsys):
    """benchmarks.data_loading --smoke: every part runs (tiny sizes) and prints its figure."""
    from benchmarks import data_loading

    monkeypatch.setattr(sys, "argv", ["data_loading", "--smoke"])
    data_loading.main()
    out = capsys.readouterr().out
    for start in ("tokenize_data.py on ", "one rank's loader, tokens/s delivered to rank 0 of D ranks:",
                  "  raw text, tokenizer.json on tiktoken's core ", "  raw text, tokenizer.json in Python ",
                  "  token files (shuffled) ", "token files at D = 8 / D = 1: ",
                  "DataLoader workers on token files (D = 8): num_workers 1 ",
                  "DataLoader workers on raw text (D = 8): num_workers 1 ", "documents encoded by 1 and 2 threads: ",
                  "one encode call of the whole text, and the longest another Python thread waited during it ",
                  "tokenizers on the same text, one thread: titan_lite tokenizer.json on tiktoken's core ",
                  "tokenize_data.py, 1 process, the same ChatML tokenizer: text ",
                  "tokenizers with a SmolLM2-sized tokenizer.json (600 tokens, without SmolLM2's 21 missing single "
                  "bytes; 2 of 40 documents hold one), one thread: titan_lite tokenizer.json on tiktoken's core "):
        assert any(line.startswith(start) for line in out.splitlines()), start
    assert out.count("ids equal HF tokenizers' on 40 of 40 documents") == 2


_STOPPED_PARENT = """
import signal, sys
from dataclasses import dataclass
from benchmarks import run
from benchmarks.framework import Settings, Variant

@dataclass
class Sleeper(Variant):
    def command(self, settings):
        script = "sleep 300 & echo $! > " + sys.argv[1] + "; echo 'progress: step 1/2'; echo other; wait"
        return ["sh", "-c", script], {}

signal.signal(signal.SIGTERM, run._stop)
run.execute(Sleeper("sleeper"), Settings(steps=1, warmup=0, threads=1), 600)
"""


def test_a_stopped_benchmark_prints_its_childs_progress_and_ends_its_process_group(tmp_path):
    import signal
    import time

    pidfile = tmp_path / "grandchild.pid"
    parent = subprocess.Popen([sys.executable, "-c", _STOPPED_PARENT, str(pidfile)], cwd=REPO, env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert parent.stdout.readline() == "    step 1/2\n"  # printed while the child runs; its other lines are not
    grandchild = int(pidfile.read_text())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 128 + signal.SIGTERM
    for _ in range(50):  # the group's SIGKILL is delivered at once; the zombie is reaped by init
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the child's own child {grandchild} outlived the stopped benchmark")


def test_the_data_benchmark_keeps_torchdatas_deprecation_warning_out_of_its_figures():
    code = "import benchmarks.data_loading\nfrom torchdata.stateful_dataloader import StatefulDataLoader\n" \
           "StatefulDataLoader([1, 2])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "set_vital" not in out.stderr, out.stderr


def test_the_qwen3_5_benchmark_runs_small_and_its_case_reads_it(capsys):
    """benchmarks/qwen3_5.py --smoke in this process: titan_lite's and transformers' steps start from equal logits,
    the chunked delta rule gives the recurrent form's outputs; the qwen3_5 case reads its result line."""
    pytest.importorskip("transformers")
    from benchmarks.qwen3_5 import main

    assert main(["--smoke"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [x.split(":")[0] for x in lines[:-1]] == ["qwen3_5 step", "delta rule"]
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    assert result["rule"]["max_diff"] <= 1e-5 and result["rule"]["tokens"] == 128
    case = CASES["qwen3_5"]()
    (variant,) = case.variants
    m = variant.metrics(RunOutput(lines[-1], 0, 1.0, 1.0, 2**30))
    assert m["logits_max_difference"] <= 1e-5 and m["titan_lite_tokens_per_s"] == 64 / m["step_s"]
    assert m["transformers_step_s"] > 0 and m["chunked_rule_s"] > 0 and m["recurrent_rule_train_s"] > 0
    assert [r.target for r in case.ratios] == [None, 1.0, 1.0]
