"""DRY_RUN=1 through ./run_train.sh: full-size plans, their printed numbers, verdicts, errors, time and memory."""

import gzip
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import benchmarks.figures as FIGURES  # its run_plan runs a plan in this process
from tests.warm_python import COLD

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
LLAMA_8B_PARAMS = 8_030_261_248
LLAMA_70B_PARAMS = 70_553_706_496

# Runs run_train.sh as a child and reports the child's CPU seconds and peak RSS (a fresh parent, so the
# RUSAGE_CHILDREN numbers belong to this one run).
_MEASURE = """
import resource, subprocess, sys, time
start = time.monotonic()
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.monotonic() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
sys.stdout.write(proc.stdout)
sys.stderr.write(proc.stderr)
print(f"MEASURED cpu={usage.ru_utime + usage.ru_stime:.2f} wall={wall:.2f} maxrss_kib={usage.ru_maxrss}")
sys.exit(proc.returncode)
"""


@dataclass
class DryRun:
    returncode: int
    stdout: str
    stderr: str
    cpu_seconds: float
    wall_seconds: float
    max_rss_bytes: int

    def local_params(self) -> list[int]:
        return [int(n.replace(",", "")) for n in re.findall(r"local parameters: ([\d,]+)", self.stdout)]

    def layer_ranges(self) -> list[tuple[int, int, int]]:
        return [tuple(map(int, m)) for m in re.findall(r": layers (\d+)-(\d+) \((\d+)\)", self.stdout)]

    def verdicts(self) -> list[tuple[float, float, float]]:
        """(peak, capacity, head-room) GiB of every role that fits."""
        found = re.findall(r"verdict: fits: peak ([\d.]+) GiB of ([\d.]+) GiB, head-room ([\d.]+) GiB", self.stdout)
        return [tuple(map(float, v)) for v in found]


@pytest.fixture(scope="module")
def c4_shard(tmp_path_factory) -> Path:
    """A small C4-style shard: gzipped JSON lines with a 'text' field."""
    path = tmp_path_factory.mktemp("c4") / "c4-train.00000-of-01024.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(20):
            f.write(json.dumps({"text": f"document {i}: the quick brown fox " * 20, "url": "x"}) + "\n")
    return path


def dry_run(config: str, shard: Path, ngpu: int, nnodes: int = 1, extra: tuple[str, ...] = (),
            measured: bool = False) -> DryRun:
    """`DRY_RUN=1 NGPU=ngpu NNODES=nnodes CONFIG_FILE=config ./run_train.sh ...`: through run_train.sh in a child
    whose CPU time and peak RSS are measured, or (not measured) titan_lite.train.main in this process, the module
    run_train.sh execs for a plan: the same lines and exit code without a fresh Python and torch."""
    args = ["--model.hf_assets_path", "./assets/tokenizer", "--training.dataset_path", str(shard), *extra]
    if not measured:
        return dry_run_in_process(config, ngpu, nnodes, args)
    env = {**os.environ, "DRY_RUN": "1", "NGPU": str(ngpu), "NNODES": str(nnodes), "OMP_NUM_THREADS": "1",
           "CONFIG_FILE": str(REPO / "train_configs" / config), **COLD}  # the child's own CPU and memory
    cmd = [sys.executable, "-c", _MEASURE, str(REPO / "run_train.sh"), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    m = re.search(r"MEASURED cpu=([\d.]+) wall=([\d.]+) maxrss_kib=(\d+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    return DryRun(proc.returncode, proc.stdout, proc.stderr, float(m[1]), float(m[2]), int(m[3]) * 1024)


def dry_run_in_process(config: str, ngpu: int, nnodes: int, args: list[str]) -> DryRun:
    start, cpu = time.monotonic(), time.process_time()
    code, out, err = FIGURES.run_plan(ngpu, str(REPO / "train_configs" / config), args, nnodes)
    return DryRun(code, out, err, time.process_time() - cpu, time.monotonic() - start, 0)


def assert_plans_fast_and_small(run: DryRun) -> None:
    # CPU seconds, not wall time: the test machine's cores are shared, the bound is about the planner's own work
    # (a measured run's host memory too; one in this process has no peak of its own: max_rss_bytes 0).
    # About 5 of them are importing torch; building a full-size model on the CPU instead would take minutes.
    assert run.cpu_seconds < 15, f"planning took {run.cpu_seconds:.1f} CPU seconds"
    assert run.max_rss_bytes < 1 * GIB, f"planning used {run.max_rss_bytes / GIB:.2f} GiB of host memory"


def assert_verdict_consistent(run: DryRun, capacity: float) -> None:
    for peak, cap, headroom in run.verdicts():
        assert cap == capacity
        assert headroom == pytest.approx(capacity - peak, abs=0.011)
    peak, _, headroom = max(run.verdicts())
    assert "dry run OK: " in run.stdout and f"head-room {headroom:.2f} GiB of {capacity:.2f} GiB" in run.stdout


def test_llama3_8b_fsdp_on_8_ranks(c4_shard):
    run = dry_run("llama3_8b.toml", c4_shard, ngpu=8, measured=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "world 8 = dp_replicate 1 x dp_shard 8 x cp 1 x tp 1 x pp 1" in run.stdout
    assert f"{LLAMA_8B_PARAMS:,} parameters" in run.stdout
    # 8B's every tensor has a first dimension divisible by 8: an exact eighth, no padding
    assert run.local_params() == [LLAMA_8B_PARAMS // 8]
    assert run.layer_ranges() == [(0, 31, 32)]
    assert "AC selective op; microbatch 1 x seq 8192, 1 in flight, bfloat16" in run.stdout
    assert len(run.verdicts()) == 1
    assert_verdict_consistent(run, 80.0)
    # sharded fp32 parameters and gradients, two fp32 AdamW moments: 4 + 4 + 8 bytes per local parameter
    params_gib = float(re.search(r"parameters\s+([\d.]+) GiB", run.stdout)[1])
    optimizer_gib = float(re.search(r"optimizer\s+([\d.]+) GiB", run.stdout)[1])
    assert params_gib == pytest.approx(LLAMA_8B_PARAMS / 8 * 4 / GIB, abs=0.005)
    assert optimizer_gib == pytest.approx(LLAMA_8B_PARAMS / 8 * 8 / GIB, abs=0.005)
    assert_plans_fast_and_small(run)


LORA_8B_ADAPTER_PARAMS = 32 * 32 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))  # r 32, 7 projections


@pytest.mark.parametrize("config, accumulation, fields",
                         [("llama3_8b_lora_metamath.toml", 4, ("query", "response")),
                          ("llama3_8b_lora_gsm8k.toml", 2, ("question", "answer"))])
def test_llama3_8b_lora_configs_on_8_ranks(tmp_path, config, accumulation, fields):
    """The instruction reader with the dataset's own fields; the bundled 2,048-token tokenizer is a warning."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({fields[0]: "What is 2 + 2?", fields[1]: "2 + 2 = 4\n#### 4"}) + "\n")
    run = dry_run(config, data, ngpu=8)
    assert f"data: instruct rows from '{data}' (tokenized once when the run starts), shuffled per epoch: " in run.stdout
    assert ("warning: the tokenizer's 2,048 tokens are far fewer than the model's vocabulary of 128,256: is "
            "'./assets/tokenizer' this model's tokenizer?") in run.stdout
    # the plan is complete; the real run would still need the base weights (initial_load_in_hf) in the assets folder
    assert run.returncode == 5, run.stdout + run.stderr
    assert "[ ] assets/tokenizer: no model.safetensors" in run.stdout and "1 missing or unreadable" in run.stdout
    assert LORA_8B_ADAPTER_PARAMS == 83_886_080
    # the base, the adapters and PiSSA's initial factors (kept for the export to the original base)
    assert f"{LLAMA_8B_PARAMS + 2 * LORA_8B_ADAPTER_PARAMS:,} parameters, 32 layers; transforms: lora" in run.stdout
    assert f"x data-parallel 8 x accumulation {accumulation} = global {32 * accumulation} sequences" in run.stdout
    trainable, frozen = LORA_8B_ADAPTER_PARAMS // 8, (LLAMA_8B_PARAMS + LORA_8B_ADAPTER_PARAMS) // 8
    assert f"{trainable:,} trainable, sharded like the parameters, float32; {frozen:,} frozen have none" in run.stdout
    # a bf16 base, fp32 adapters (and initial factors); gradients and AdamW moments for the adapters only
    params_gib = float(re.search(r"parameters\s+([\d.]+) GiB", run.stdout)[1])
    optimizer_gib = float(re.search(r"optimizer\s+([\d.]+) GiB", run.stdout)[1])
    assert params_gib == pytest.approx((LLAMA_8B_PARAMS * 2 + 2 * LORA_8B_ADAPTER_PARAMS * 4) / 8 / GIB, abs=0.005)
    assert optimizer_gib == pytest.approx(trainable * 8 / GIB, abs=0.005)
    assert "bfloat16/float32" in run.stdout and len(run.verdicts()) == 1
    assert_verdict_consistent(run, 80.0)
    assert_plans_fast_and_small(run)


SHEARED_TARGET = "26 layers, 24 heads / 8 KV heads, dim 3686, intermediate 8602 = 4,203,930,918 parameters"


def test_llama3_8b_sheared_pruning_and_its_continued_pretraining_on_2_ranks(c4_shard):
    pruning = dry_run("llama3_8b_sheared.toml", c4_shard, ngpu=2)
    assert pruning.returncode == 5, pruning.stdout + pruning.stderr  # only the base weights are missing
    assert f"sheared: target {SHEARED_TARGET}; 463,008 gate logits + 8 multipliers" in pruning.stdout
    # the gates and multipliers are parameters of the plan: 8B + 463,008 + 8
    assert f"llama3 8B, {LLAMA_8B_PARAMS + 463_016:,} parameters" in pruning.stdout
    assert "x data-parallel 2 x accumulation 8 = global 64 sequences x 128 tokens" in pruning.stdout
    assert_verdict_consistent(pruning, 80.0)
    # the continued pre-training config's flavor is exactly the architecture the pruning run materialises
    continued = dry_run("llama3_8b_sheared_continue.toml", c4_shard, ngpu=2)
    assert continued.returncode == 5, continued.stdout + continued.stderr
    assert "model: llama3 8B_sheared, 4,203,930,918 parameters, 26 layers" in continued.stdout
    assert_verdict_consistent(continued, 80.0)
    for run in (pruning, continued):
        assert len(run.verdicts()) == 1
        assert_plans_fast_and_small(run)


def test_llama3_70b_tp8_pp2_fsdp4_on_64_ranks(c4_shard):
    run = dry_run("llama3_70b.toml", c4_shard, ngpu=8, nnodes=8, measured=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "world 64 = dp_replicate 1 x dp_shard 4 x cp 1 x tp 8 x pp 2" in run.stdout
    # 80 layers + 1 (embeddings) + 1 (head) = 82 units, 41 per stage: 40 layers each
    assert run.layer_ranges() == [(0, 39, 40), (40, 79, 40)]
    assert "layers 0-39 (40) + embeddings\n" in run.stdout and "layers 40-79 (40) + output head\n" in run.stdout
    stage0, stage1 = run.local_params()
    # Projections, embeddings and head split over tp 8 x fsdp 4 = 32 ranks exactly; RMSNorm weights are
    # replicated over TP (sequence parallel) and split over fsdp 4 only, so 32 ranks hold them 8 times.
    norm_params = 8192 * (2 * 80 + 1)
    assert (stage0 + stage1) * 32 == LLAMA_70B_PARAMS + 7 * norm_params
    assert stage1 - stage0 == 8192 // 4  # the final norm; embeddings and head are the same size
    assert "AC full; microbatch 1 x seq 8192, 2 in flight" in run.stdout  # 1F1B: pp - pp_rank
    assert "AC full; microbatch 1 x seq 8192, 1 in flight" in run.stdout
    assert len(run.verdicts()) == 2
    assert_verdict_consistent(run, 80.0)
    assert_plans_fast_and_small(run)


def test_llama3_2_1b_workflow_fits_24_gib(c4_shard):
    run = dry_run("llama3_2_1b_pretrain.toml", c4_shard, ngpu=4, extra=("--dry_run.device_memory_gib", "24"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "batch: local 1 x data-parallel 4 x accumulation 128 = global 512 sequences" in run.stdout
    assert run.local_params() == [1_235_814_400 // 4]  # tied embedding counted once
    assert_verdict_consistent(run, 24.0)
    peak, _, headroom = run.verdicts()[0]
    assert headroom > 4  # the point of the workflow: ZeRO-3 style sharding leaves room on a 24 GB card


def test_one_rank_is_one_rank(c4_shard):
    run = dry_run("debug_model.toml", c4_shard, ngpu=1)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "dry run OK: 1 rank; largest peak" in run.stdout


@pytest.mark.parametrize("base", ["bfloat16", "nf4"], ids=["lora", "qlora"])
def test_llama3_8b_chat_lora_fits_24_gib_with_its_mask_planned(tmp_path, base):
    """The chat config (messages, the Llama 3 instruct template, packed block-causal) on one 24 GB GPU, with a
    bf16 base (LoRA) or an NF4 one (QLoRA); the plan counts the mask of packed documents."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello."}]}) + "\n")
    run = dry_run("llama3_8b_chat_lora.toml", data, ngpu=1,
                  extra=("--dry_run.device_memory_gib", "24", "--lora.base_dtype", base))
    # complete but for the base weights (initial_load_in_hf) that the bundled assets folder lacks
    assert run.returncode == 5, run.stdout + run.stderr
    assert "1 missing or unreadable" in run.stdout and "no model.safetensors" in run.stdout
    assert "microbatch 1 x seq 4096, 1 in flight, bfloat16, block-causal (sdpa) 0.03 GiB of mask and RoPE rows" \
        in run.stdout  # 4096 x 4096 bfloat16 query-key pairs
    assert len(run.verdicts()) == 1
    assert_verdict_consistent(run, 24.0)
    peak = run.verdicts()[0][0]
    assert peak < (12 if base == "nf4" else 20)  # the NF4 base: about a quarter of the bf16 one's 15 GiB
    assert_plans_fast_and_small(run)


def test_plan_that_does_not_fit_exits_2_with_one_line(c4_shard):
    run = dry_run("llama3_8b.toml", c4_shard, ngpu=8, extra=("--dry_run.device_memory_gib", "24"))
    assert run.returncode == 2
    assert "does NOT fit" in run.stdout
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the plan does not fit: rank 0 needs an estimated" in errors[0]
    assert "24.00 GiB" in errors[0] and "Traceback" not in run.stderr


def test_layout_that_does_not_divide_exits_2_with_the_arithmetic(c4_shard):
    run = dry_run("llama3_70b.toml", c4_shard, ngpu=8, nnodes=3)
    assert run.returncode == 2
    assert ("error: parallel degrees do not divide the world size: world 24 is not divisible by "
            "dp_replicate 1 x cp 1 x tp 8 x pp 2 = 16") in run.stderr
    assert "Traceback" not in run.stderr


def test_dry_run_rank_plans_only_the_chosen_rank(monkeypatch, capsys):
    """In-process: DRY_RUN_RANK picks one rank; debugmodel's 6 layers + 2 ends over 2 stages is 3 layers each."""
    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run as plan

    monkeypatch.setenv("NGPU", "4")
    monkeypatch.setenv("NNODES", "1")
    monkeypatch.setenv("DRY_RUN_RANK", "3")
    monkeypatch.chdir(REPO)
    cfg = parse_args(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
                      "--parallelism.pipeline_parallel_degree", "2",
                      "--parallelism.pipeline_parallel_microbatch_size", "4",
                      "--dry_run.device_memory_gib", "1"])
    assert plan(cfg) == 0
    out = capsys.readouterr().out
    assert "rank 3 (pp rank 1; 2 ranks alike): layers 3-5 (3) + output head\n" in out
    assert "rank 0 " not in out
    # 2 fsdp ranks share stage 1: 3 layers, final norm, output head, all split in two
    dim, ffn, vocab = 256, 768, 2048
    per_layer = 4 * dim * dim + 3 * dim * ffn + 2 * dim
    assert re.search(r"local parameters: ([\d,]+)", out)[1] == f"{(3 * per_layer + dim + vocab * dim) // 2:,}"


@pytest.mark.parametrize("config,ngpu,nnodes,extra,message", [
    # 32 query heads split over 16, but 8 kv heads cannot be
    ("llama3_8b.toml", 16, 1, ("--parallelism.tensor_parallel_degree", "16"),
     "error: 'parallelism.tensor_parallel_degree' = 16 must divide the model's n_kv_heads (8)"),
    # 1F1B over 2 stages needs 2 microbatches; local batch 1 / microbatch 1 is 1
    ("llama3_70b.toml", 8, 8, ("--training.local_batch_size", "1"),
     "needs at least as many microbatches as stages (2), but 'training.local_batch_size' 1 / microbatch_size 1 = 1"),
])
def test_shapes_that_do_not_divide_exit_2(c4_shard, config, ngpu, nnodes, extra, message):
    run = dry_run(config, c4_shard, ngpu=ngpu, nnodes=nnodes, extra=extra)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr


def test_plan_before_downloading_lists_what_is_missing_and_exits_5(tmp_path, monkeypatch, capsys):
    """In-process (run_train.sh's DRY_RUN=1 runs exactly this): a laptop without the tokenizer or the data. The plan
    and its verdict still print (the flavor gives the vocabulary), with a checklist; exit 5 says the real run could
    not start yet."""
    from titan_lite.train import main

    monkeypatch.setenv("DRY_RUN", "1")
    monkeypatch.setenv("NGPU", "8")
    monkeypatch.setenv("NNODES", "1")
    monkeypatch.chdir(REPO)
    code = main(["--job.config_file", "train_configs/llama3_8b.toml", "--job.dump_folder", str(tmp_path / "out"),
                 "--model.hf_assets_path", str(tmp_path / "Llama-3.1-8B"),
                 "--training.dataset_path", str(tmp_path / "c4")])
    out, err = capsys.readouterr()
    assert code == 5, out + err
    assert f"tokenizer: not there yet ('{tmp_path / 'Llama-3.1-8B'}'); vocabulary 128,256 from flavor '8B'\n" in out
    assert ("before the real run can start (2 missing or unreadable):\n"
            f"  [ ] tokenizer path '{tmp_path / 'Llama-3.1-8B'}' does not exist (expected a tokenizer.json or "
            "tokenizer.model file, or a folder holding one)\n"
            f"  [ ] 'training.dataset_path' = '{tmp_path / 'c4'}' does not exist\n") in out
    assert "8,030,261,248 parameters" in out and "verdict: fits: peak" in out and "dry run OK: 8 ranks" in out
    assert out.rstrip().splitlines()[-1] == ("the real run cannot start yet: 2 file(s) of the checklist above are "
                                             "missing (exit 5)")
    assert err == "" and not (tmp_path / "out").exists()


def test_llama3_8b_minitron_distillation_counts_the_teacher_on_8_ranks(c4_shard):
    """The 4.5B width-pruned student and its frozen 8B teacher on 8 GPUs: the teacher's bf16 eighth (no gradients or
    AdamW state) and its logits are in the plan, the teacher's missing folder is on the checklist."""
    run = dry_run("llama3_8b_minitron.toml", c4_shard, ngpu=8)
    assert run.returncode == 5, run.stdout + run.stderr  # the student's weights and the teacher are not here
    assert "model: llama3 8B_minitron_width, 4,512,746,496 parameters, 32 layers" in run.stdout
    assert (f"distill: teacher 8B from './assets/hf/Llama-3.1-8B', {LLAMA_8B_PARAMS:,} parameters in bfloat16, "
            "frozen (no gradients or optimizer state)") in run.stdout
    assert "'distill.teacher_path' = 'assets/hf/Llama-3.1-8B': no Hugging Face folder" in run.stdout
    assert f"teacher {LLAMA_8B_PARAMS // 8:,} local x bfloat16 (frozen)" in run.stdout
    assert "teacher logits 8,192 x 128,256" in run.stdout
    student = 4_512_746_496 // 8 * 4
    params_gib = float(re.search(r"parameters\s+([\d.]+) GiB", run.stdout)[1])
    assert params_gib == pytest.approx((student + LLAMA_8B_PARAMS // 8 * 2) / GIB, abs=0.01)
    assert len(run.verdicts()) == 1
    assert_verdict_consistent(run, 80.0)
    assert_plans_fast_and_small(run)
