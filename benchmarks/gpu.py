"""The GPU lane: one command that proves and measures titan_lite on a CUDA machine and writes it all to GPU.md.

    .venv/bin/python -m benchmarks.gpu                        # every case (CUDA; about 30 min on one H100)
    .venv/bin/python -m benchmarks.gpu --cases correctness,memory
    .venv/bin/python -m benchmarks.gpu --smoke                # every case with tiny shapes on CPU (what CI runs)
    .venv/bin/python -m benchmarks.gpu --list

Cases: correctness (the CUDA-marked tests, `pytest -m cuda`), training throughput and MFU at torchtitan's settings
(Llama 3.2 1B, and Llama 3.1 8B cut to the layers one GPU holds: sequence 8192, batch 1, bf16, full AC; eager,
compile, compile + float8; LoRA and QLoRA on the 8B cut) beside torchtitan's published per-GPU figures, memory
(each training run's CUDA peak beside DRY_RUN's estimate of the same config), 2:4 sparsity (generation with
semi-structured sparse linears against dense), Qwen3.5 (the chunked delta rule against its recurrent form and FLA's
kernel, and a training step against transformers'), MoE experts (one grouped matmul against a loop over experts), and
the data loader (one rank's tokens/s at D = 1, 8, 64, raw text against token files, on the host's CPU). A case
whose hardware or transform is missing is skipped with the reason. Each case prints one result line or more; the last
line counts them.
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.cli import parser
from benchmarks.training_run import REPO, Job, estimate_bytes, measure, worker_python

GIB = 1024**3
CASE_LIMIT_S = 480  # no case over 8 minutes on one H100

# torchtitan's published per-GPU tokens/s for Llama 3.1 8B (benchmarks/llama3_h100_202412_torchtitan.md, 8 H100s
# 96 GB at 500 W, FSDP, local batch 2, seq 8192, selective AC; ../shared/reference/torchtitan.md).
TORCHTITAN_8B = {"eager": 5762, "compile": 6667, "compile+float8": 8532}
TORCHTITAN_NOTE = "torchtitan 8B on 8 H100 (FSDP, lbs 2, selective AC; 33-39% MFU without float8)"


@dataclass
class Lane:
    """What every case shares: smoke mode, the device, and the training runs measured so far (the memory case
    reads them rather than training again)."""

    smoke: bool
    device: torch.device
    test_workers: int = 1
    log_dir: Path | None = None
    runs: dict[str, tuple[Job, dict]] = field(default_factory=dict)

    def keep_log(self, name: str, text: str) -> None:
        """A case's whole output, beside the report's one line, where --log_dir asks for it."""
        if self.log_dir is not None and text:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"{name}.log").write_text(text)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def capability(self) -> tuple[int, int]:
        return torch.cuda.get_device_capability(self.device) if self.cuda else (0, 0)

    def capacity_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory if self.cuda else 8 * GIB


@dataclass
class Line:
    """One result line: its text, and whether it is a skip (with the reason in the text) or a failure."""

    text: str
    status: str = "ok"  # ok, skipped, failed


CASES: dict[str, Callable[[Lane], list[Line]]] = {}


def case(name: str) -> Callable:
    def register(fn: Callable[[Lane], list[Line]]) -> Callable[[Lane], list[Line]]:
        CASES[name] = fn
        return fn
    return register


# ------------------------------------------------------------------------------------- availability


def transform_available(name: str) -> bool:
    from titan_lite.transforms import registered_transforms

    return name in registered_transforms()


def nf4_base_available() -> bool:
    """QLoRA is in this checkout: 'lora.base_dtype' accepts "nf4"."""
    import typing

    from titan_lite.config.schema import Lora

    return "nf4" in typing.get_args(typing.get_type_hints(Lora).get("base_dtype"))


FLOAT8 = "quantize.linear.float8"


def float8_missing(lane: Lane) -> str | None:
    """Why float8 cannot run here, or None."""
    if not transform_available(FLOAT8):
        return f"the '{FLOAT8}' transform is not in this checkout"
    if lane.cuda and lane.capability() < (8, 9):
        return f"float8 matmuls need compute capability 8.9+, this GPU has {lane.capability()}"
    return None


def qlora_missing(lane: Lane) -> str | None:
    if not nf4_base_available():
        return "QLoRA ('lora.base_dtype = \"nf4\"') is not in this checkout"
    return None


# ------------------------------------------------------------------------------------------ correctness


@case("correctness")
def correctness(lane: Lane) -> list[Line]:
    """The CUDA-marked tests (tests/test_cuda.py); without CUDA they are all skipped, each with its reason."""
    import importlib.util

    # the tests are launches of small jobs: several at once share one GPU well (pytest-xdist, where installed)
    workers = ["-n", str(lane.test_workers)] if lane.test_workers > 1 and importlib.util.find_spec("xdist") else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider",
                           *workers, "tests/test_cuda.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=CASE_LIMIT_S,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)))
    lane.keep_log("correctness", proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else "no output"
    failed = [x for x in lines if x.startswith("FAILED")]
    if proc.returncode not in (0, 5) or failed:
        return [Line(f"correctness: {summary}", "failed")] + [Line(f"  {x}", "failed") for x in failed]
    if "passed" not in summary:
        reason = next((re.sub(r"^SKIPPED \[\d+\] [^:]+(:\d+)?: ", "", x) for x in lines if x.startswith("SKIPPED")),
                      "nothing ran")
        return [Line(f"correctness: skipped: pytest -m cuda: {summary}: {reason}", "skipped")]
    return [Line(f"correctness: pytest -m cuda: {summary}")]


# ------------------------------------------------------------------------------------------ training


def fitting_layers(flavor: str, lane: Lane, make: Callable[[int], Job], budget: float = 0.85) -> int:
    """The most layers of `flavor` whose DRY_RUN estimate fits budget x this device's memory."""
    from titan_lite.models.flavors import flavor_args

    low, high = 1, flavor_args(flavor).n_layers  # the estimate grows with the layers: bisect
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if estimate_bytes(make(mid)) <= budget * lane.capacity_bytes() else (low, mid - 1)
    return low


def train_job(lane: Lane, model: str, variant: str) -> Job:
    """torchtitan's settings (seq 8192, batch 1, bf16, full AC) on the 1B or the cut 8B; tiny shapes in smoke mode."""
    compile_ = variant != "eager" and not variant.startswith(("lora", "qlora"))
    overrides = []
    if "float8" in variant:
        overrides += ["--model.converters", FLOAT8]
    if variant.startswith(("lora", "qlora")):
        overrides += ["--model.converters", "lora", "--lora.rank", "16", "--lora.alpha", "32"]
        overrides += ["--lora.base_dtype", "nf4"] if variant.startswith("qlora") else []
    if lane.smoke:
        # aot_eager: the compile path (dynamo and AOT autograd) without inductor's minutes of C++ builds on 2 cores
        # the estimate of the CPU's own step (float32), which is what runs here
        return Job("tiny", 64, batch=2, n_layers=2 if model == "8b" else None, ac="full", compile=compile_,
                   compile_backend="aot_eager", overrides=[*overrides, "--dry_run.device_type", "cpu"], steps=2,
                   warmup=1)
    flavor = "1B" if model == "1b" else "8B"

    def make(n_layers: int | None) -> Job:
        return Job(flavor, 8192, batch=1, n_layers=n_layers, ac="full", compile=compile_, overrides=overrides,
                   steps=5, warmup=3 if compile_ else 2)
    return make(None if model == "1b" else fitting_layers(flavor, lane, make))


def training_line(name: str, job: Job, result: dict, reference: int | None) -> Line:
    if "error" in result:
        return Line(f"{name}: failed: {result['error']}", "failed")
    shape = f"{job.flavor_name()}, {job.batch} x {job.seq_len}, AC {job.ac}"
    mfu = f", MFU {result['mfu_pct']:.1f}%" if "mfu_pct" in result else ""
    # a cut model has fewer layers per token than the whole 8B: its MFU, not its tokens/s, compares
    ref = f"; {TORCHTITAN_NOTE}: {reference:,} tokens/s per GPU" if reference else ""
    peak = f"peak {result['peak_bytes'] / GIB:.2f} GiB" if result["peak_bytes"] is not None else "peak not measured"
    return Line(f"{name}: {result['tokens_per_s']:,.0f} tokens/s{mfu}, step {result['step_s']:.3f} s ({shape}; "
                f"{peak}){ref}")


def train_case(model: str, variant: str) -> Callable[[Lane], list[Line]]:
    def run(lane: Lane) -> list[Line]:
        name = f"train_{model}_{variant}"
        missing = float8_missing(lane) if "float8" in variant else qlora_missing(lane) if variant == "qlora" else None
        if missing:
            return [Line(f"{name}: skipped: {missing}", "skipped")]
        if lane.cuda is False and not lane.smoke:
            return [Line(f"{name}: skipped: no CUDA device (run with --smoke for the CPU plumbing check)", "skipped")]
        job = train_job(lane, model, variant)
        result = measure(job, timeout=CASE_LIMIT_S)
        lane.keep_log(name, result.get("log_tail", ""))
        lane.runs[name] = (job, result)
        reference = TORCHTITAN_8B.get(variant) if model == "8b" and not lane.smoke else None
        return [training_line(name, job, result, reference)]
    return run


for _model, _variants in (("1b", ("eager", "compile", "compile+float8")),
                          ("8b", ("eager", "compile", "compile+float8", "lora", "qlora"))):
    for _variant in _variants:
        case(f"train_{_model}_{_variant}")(train_case(_model, _variant))


@case("memory")
def memory(lane: Lane) -> list[Line]:
    """Each training run of this lane: its measured peak beside DRY_RUN's estimate of the same config."""
    if not any("error" not in r for _, r in lane.runs.values()):
        CASES["train_1b_eager"](lane)
    lines = []
    for name, (job, result) in lane.runs.items():
        if "error" in result:
            continue
        if result["peak_bytes"] is None:
            lines.append(Line(f"memory {name}: skipped: {result['peak_source']}", "skipped"))
            continue
        estimate = estimate_bytes(job)
        lines.append(Line(f"memory {name}: measured {result['peak_bytes'] / GIB:.3f} GiB ({result['peak_source']}), "
                          f"DRY_RUN estimate {estimate / GIB:.3f} GiB, estimate / measured "
                          f"{estimate / result['peak_bytes']:.3f}"))
    return lines or [Line("memory: failed: no training run succeeded", "failed")]


# ------------------------------------------------------------------------------------------ 2:4 sparsity


def two_four_prune_(model: torch.nn.Module) -> int:
    """Zero the 2 smallest-magnitude weights of every 4 consecutive inputs in each block linear; returns the count."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("layers."):
            w = module.weight.data
            groups = w.view(w.shape[0], -1, 4)
            drop = groups.abs().argsort(dim=-1)[..., :2]
            groups.scatter_(-1, drop, 0)
            count += 1
    return count


def timed_generation(model, prompts, new_tokens: int, device: torch.device) -> tuple[float, list[list[int]]]:
    from titan_lite.generate import GenerationConfig, generate

    generate(model, prompts, GenerationConfig(max_new_tokens=4), device)  # warm-up (kernels, cuSPARSELt plans)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = generate(model, prompts, GenerationConfig(max_new_tokens=new_tokens), device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sum(map(len, out)) / (time.perf_counter() - start), out


class FlatSparseLinear(torch.nn.Module):
    """A linear whose weight is a 2:4 semi-structured sparse tensor, fed 2-D: a 3-D input goes through matmul's
    batched path, whose `expand` the sparse tensor does not implement (seen on an H200 with torch 2.11)."""

    def __init__(self, linear: torch.nn.Linear):
        from torch.sparse import to_sparse_semi_structured

        super().__init__()
        self.weight = torch.nn.Parameter(to_sparse_semi_structured(linear.weight.data), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


@case("sparsity")
def sparsity(lane: Lane) -> list[Line]:
    """A 2:4-pruned model's generation tokens/s with its block linears as semi-structured sparse tensors (sm80+)
    against the same pruned weights dense."""
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    if not lane.cuda and not lane.smoke:
        return [Line("sparsity: skipped: no CUDA device", "skipped")]
    flavor, batch, prompt_len, new = ("tiny", 2, 8, 8) if lane.smoke else ("1B", 16, 128, 128)
    args = flavor_args(flavor)
    args.max_seq_len = prompt_len + new
    dtype = torch.float16 if lane.cuda else torch.float32
    with torch.device(lane.device):
        model = Llama(args)
    model.init_weights(seed=0)
    model = model.to(dtype).eval()
    pruned = two_four_prune_(model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (batch, prompt_len), generator=g).tolist()
    with torch.no_grad():
        dense_tps, dense_out = timed_generation(model, prompts, new, lane.device)
    dense = Line(f"sparsity: dense 2:4-pruned {flavor} ({pruned} block linears), {batch} x {prompt_len}+{new} tokens: "
                 f"{dense_tps:,.0f} generated tokens/s")
    if not lane.cuda or lane.capability() < (8, 0):
        why = "no CUDA device" if not lane.cuda else f"compute capability {lane.capability()} < 8.0"
        return [dense, Line(f"sparsity: semi-structured sparse linears skipped: {why} (torch's 2:4 kernels need "
                            "CUDA sm80+)", "skipped")]
    try:
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and name.startswith("layers."):
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, FlatSparseLinear(module))
        with torch.no_grad():
            sparse_tps, sparse_out = timed_generation(model, prompts, new, lane.device)
    except (RuntimeError, NotImplementedError, ValueError) as error:
        return [dense, Line(f"sparsity: semi-structured sparse failed: {str(error).splitlines()[0]}", "failed")]
    same = sum(a == b for a, b in zip(dense_out, sparse_out, strict=True))
    return [dense, Line(f"sparsity: semi-structured sparse: {sparse_tps:,.0f} generated tokens/s, "
                        f"{sparse_tps / dense_tps:.2f}x dense; {same}/{batch} greedy continuations identical")]


# ------------------------------------------------------------------------------------------ GRPO


@case("grpo")
def grpo(lane: Lane) -> list[Line]:
    """Issue 46: GRPO steps on the 1B with LoRA (benchmarks/grpo.py): 8 prompts x 8 completions of up to 256 tokens
    sampled by the policy with the KV cache; rollout tokens/s, and the step split into generation and training."""
    from benchmarks.worker import RESULT_PREFIX

    if not lane.cuda and not lane.smoke:
        return [Line("grpo: skipped: no CUDA device", "skipped")]
    flavor, new, seq, words, steps, warmup = ("tiny", 8, 128, 8, 1, 0) if lane.smoke else ("1B", 256, 1024, 120, 2, 1)
    cmd = [worker_python(), "-m", "benchmarks.grpo", "--flavor", flavor, "--max_new", str(new), "--seq_len", str(seq),
           "--most_words", str(words), "--steps", str(steps), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CASE_LIMIT_S)
    lane.keep_log("grpo", proc.stdout + proc.stderr)
    found = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not found:
        return [Line(f"grpo: failed: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}", "failed")]
    r = json.loads(found[-1][len(RESULT_PREFIX):])
    generation, train = sum(r["generation_s"]), sum(r["train_s"])
    steps_run = len(r["train_s"])
    return [Line(f"grpo: {flavor} LoRA, 64 completions of up to {new} tokens a step: rollout "
                 f"{sum(r['completion_tokens']) / generation:,.0f} tokens/s with the KV cache; a step "
                 f"{generation / steps_run:.2f} s generating + {train / steps_run:.2f} s training "
                 f"({sum(r['reference_s']) / steps_run:.2f} s of it the reference's forwards), "
                 f"{sum(r['real_tokens']) / train:,.0f} training tokens/s")]


@case("rollout")
def rollout(lane: Lane) -> list[Line]:
    """Issue 57: the rollout's decode engine on the 1B (bf16, 64 completions of lengths over 8x, 32 slots, the step
    compiled with CUDA graphs) against the static batch, its tokens/s against vLLM's where vLLM is importable."""
    from titan_lite.generate import GenerationConfig
    from titan_lite.generate.engine import EngineStats, decode_slots

    if not lane.cuda and not lane.smoke:
        return [Line("rollout: skipped: no CUDA device", "skipped")]
    from benchmarks.rollout import Workload, model_of

    flavor, longest, slots = ("tiny", 16, 8) if lane.smoke else ("1B", 256, 32)
    with torch.device(lane.device):
        model = model_of(flavor)
    model = model.to(torch.bfloat16 if lane.cuda else torch.float32)
    w = Workload.draw(model.args.vocab_size, 8, 8, 128 if lane.cuda else 16, longest, 8)
    cfg = GenerationConfig(max_new_tokens=longest, temperature=1.0, stop_ids=(w.stop,), keep_stop=True,
                           slots=slots, compile=lane.cuda)
    decode_slots(model, w.prompts[:slots], cfg, lane.device, w.uniforms[:slots])  # warm-up (and capture)
    stats = EngineStats()
    start = time.perf_counter()
    decoded = decode_slots(model, w.prompts, cfg, lane.device, w.uniforms, stats=stats)
    if lane.cuda:
        torch.cuda.synchronize(lane.device)
    tokens = sum(len(d.tokens) for d in decoded)
    tps = tokens / (time.perf_counter() - start)
    lines = [Line(f"rollout: {flavor}, {len(w.prompts)} completions of {min(w.lengths)}-{max(w.lengths)} tokens in "
                  f"{slots} slots{' (compiled, CUDA graphs)' if lane.cuda else ''}: {tps:,.0f} tokens/s, "
                  f"{100 * stats.working_share:.0f}% of slot-steps working, prefill "
                  f"{100 * stats.prefill_s / stats.total_s:.0f}% of the rollout ({stats.prefills} prefills)")]
    try:
        import vllm  # noqa: F401  (optional: the GPU lane brings its wheel)
    except ImportError:
        return lines + [Line("rollout: vLLM skipped: vllm is not importable here", "skipped")]
    return lines + [vllm_line(model, w, tps)]


def vllm_line(model, w, engine_tps: float) -> Line:
    """vLLM's tokens/s on the same weights (saved as a Hugging Face folder), prompts and lengths (ignore_eos and
    max_tokens per completion)."""
    import tempfile

    from vllm import LLM, SamplingParams

    from titan_lite.checkpoint.hf import write_hf_folder

    with tempfile.TemporaryDirectory() as folder:
        write_hf_folder(model.state_dict(), model.args, folder, torch.bfloat16, str(REPO / "assets/tokenizer"))
        llm = LLM(folder, dtype="bfloat16", gpu_memory_utilization=0.5)
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in w.lengths]
        prompts = [{"prompt_token_ids": p} for p in w.prompts]
        llm.generate(prompts[:8], params[:8])
        start = time.perf_counter()
        llm.generate(prompts, params)
        tps = sum(w.lengths) / (time.perf_counter() - start)
    return Line(f"rollout: vLLM {tps:,.0f} tokens/s on the same prompts and lengths: the engine "
                f"{engine_tps / tps:.2f}x vLLM's (goal 0.7x)")


# ------------------------------------------------------------------------------------------ Qwen3.5


@case("qwen3_5")
def qwen3_5(lane: Lane) -> list[Line]:
    """Issue 55: Qwen3.5's gated delta rule on 2048 tokens with Qwen3.5-35B-A3B's linear heads (16 key, 32 value heads
    of 128; bf16 in, float32 state): titan_lite's chunked form against the recurrent form and FLA's
    chunk_gated_delta_rule where fla-core is installed; and a float32 training step of titan_lite against
    transformers' Qwen3_5ForCausalLM with the same weights (benchmarks/qwen3_5.py)."""
    if not lane.cuda and not lane.smoke:
        return [Line("qwen3_5: skipped: no CUDA device", "skipped")]
    shapes = ["--smoke"] if lane.smoke else ["--layers", "8", "--seq", "4096", "--batch", "2", "--steps", "5",
                                             "--warmup", "2", "--rule_heads", "16,32,128,128", "--rule_rounds", "5"]
    cmd = [worker_python(), "-m", "benchmarks.qwen3_5", "--device", lane.device.type, *shapes]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CASE_LIMIT_S)
    lane.keep_log("qwen3_5", proc.stdout + proc.stderr)
    printed = [x for x in proc.stdout.splitlines() if x.startswith(("qwen3_5 step: ", "delta rule: "))]
    if proc.returncode != 0 or len(printed) != 2:
        return [Line(f"qwen3_5: failed: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}",
                     "failed")]
    lines = [Line(f"qwen3_5: {x.removeprefix('qwen3_5 ')}") for x in printed]
    if not lane.cuda:
        lines.append(Line("qwen3_5: FLA's chunk_gated_delta_rule skipped: it needs CUDA", "skipped"))
    return lines


# ------------------------------------------------------------------------------------------ MoE experts


@case("moe_experts")
def moe_experts(lane: Lane) -> list[Line]:
    """One MoE layer's experts, forward and backward, as one torch._grouped_mm against one matmul per expert
    (Qwen3-30B-A3B's expert widths, bf16; benchmarks/moe_experts.py)."""
    from benchmarks.moe_experts import measure as measure_experts

    if not lane.cuda and not lane.smoke:
        return [Line("moe_experts: skipped: no CUDA device", "skipped")]
    # (experts, dim, hidden, top-k, tokens): a 30B-A3B layer on 8192 tokens; debugmodel_moe's on 256 in smoke mode
    shape, dtype, repeats = ((8, 256, 256, 2, 256), torch.float32, 1) if lane.smoke else \
        ((128, 2048, 768, 8, 8192), torch.bfloat16, 10)
    got = measure_experts(shape, repeats, lane.device, dtype)
    kernel = "torch._grouped_mm" if got["grouped_kernel"] else "the loop (grouped_mm does not run here)"
    return [Line(f"moe_experts: {shape[0]} experts {shape[1]} -> {shape[2]}, top {shape[3]}, {shape[4]:,} tokens, "
                 f"{str(dtype).removeprefix('torch.')}: grouped {got['grouped'] * 1e3:.2f} ms ({kernel}), loop "
                 f"{got['loop'] * 1e3:.2f} ms, grouped / loop {got['grouped'] / got['loop']:.2f}x")]


# ------------------------------------------------------------------------------------------ data loader


@case("loader")
def loader(lane: Lane) -> list[Line]:
    """One rank's data loader at D = 1, 8 and 64 (rank 0's loader, local batch 1, sequences of 2048): raw text, which
    every rank tokenizes whole (Llama 3's tiktoken layout, the bundled vocabulary), against token files, which each
    rank reads its own share of; on this machine's host CPU (benchmarks/data_loading.py has the full sweep)."""
    import tempfile

    from benchmarks.data_loading import loader_table, write_lines
    from titan_lite.data.token_chunks import RecordEncoder
    from titan_lite.data.token_writer import write_token_folder
    from titan_lite.data.tokenizer import build_tokenizer

    seq_len, seconds = (64, 0.2) if lane.smoke else (2048, 3.0)
    with tempfile.TemporaryDirectory() as tmp:
        lines = write_lines(Path(tmp), limit=40 if lane.smoke else None)
        tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))
        write_token_folder(Path(tmp) / "tokens", [str(lines)], RecordEncoder("text", tokenizer),
                           report=lambda line: None)
        figures = loader_table(lines, Path(tmp) / "tokens", {"tiktoken": tokenizer}, seq_len, (1, 8, 64), seconds,
                               report=lambda line: None)
    return [Line(f"loader {name}: " + ", ".join(f"D = {d} {rate:,.0f}" for d, rate in zip((1, 8, 64), rates,
                                                                                          strict=True))
                 + " tokens/s per rank") for name, rates in figures.items()]


# ------------------------------------------------------------------------------------------ report


def shell(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def header(lane: Lane) -> list[str]:
    if lane.cuda:
        device = f"{torch.cuda.get_device_name(lane.device)} ({lane.capacity_bytes() / GIB:.0f} GiB, " \
                 f"sm{''.join(map(str, lane.capability()))})"
        driver = shell(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[:1]
        driver_text = f"driver {driver[0] if driver else 'unknown'}, CUDA {torch.version.cuda}"
    else:
        device, driver_text = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", "no GPU"
    commit = shell(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = " (uncommitted changes)" if shell(["git", "status", "--porcelain", "--untracked-files=no"]) else ""
    return [f"device: {device}; torch {torch.__version__}; {driver_text}",
            f"commit {commit}{dirty}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
            + ("; SMOKE (tiny shapes on CPU: checks the lane's plumbing, not the GPU)" if lane.smoke else "")]


def write_report(path: Path, head: list[str], lines: list[Line], command: str) -> None:
    body = "\n".join(line.text for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# GPU lane results\n\nWritten by `.venv/bin/python -m benchmarks.gpu` (see its `--help`).\n\n"
                    + "\n".join(f"- {h}" for h in head) + f"\n\n```\n$ {command}\n{body}\n```\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.gpu")
    p.add_argument("--cases", default=",".join(CASES), help="comma list of cases (default: all; see --list)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: check that every case runs")
    p.add_argument("--out", default=None, help="the report (default: GPU.md, or outputs/gpu_smoke.md with --smoke)")
    p.add_argument("--test_workers", type=int, default=1,
                   help="pytest-xdist workers for the correctness case, where pytest-xdist is installed (default 1)")
    p.add_argument("--log_dir", default=None, help="a folder for each case's whole output (a failure's traceback)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.list:
        for name, fn in CASES.items():
            print(f"{name}: {(fn.__doc__ or 'training throughput and MFU').splitlines()[0]}")
        return 0
    names = [n for n in opts.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"error: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not opts.smoke
    if not cuda and not opts.smoke:
        print("error: no CUDA device here (torch.cuda.is_available() is False); run with --smoke to check the lane on "
              "CPU", file=sys.stderr)
        return 2
    lane = Lane(smoke=opts.smoke, device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
                test_workers=opts.test_workers, log_dir=Path(opts.log_dir) if opts.log_dir else None)
    head = header(lane)
    print("\n".join(head), flush=True)
    out = Path(opts.out or ("outputs/gpu_smoke.md" if opts.smoke else "GPU.md"))
    out = out if out.is_absolute() else REPO / out
    lines: list[Line] = []
    start = time.perf_counter()
    for name in names:
        case_start = time.perf_counter()
        print(f"[{name}] running", flush=True)
        try:
            got = CASES[name](lane)
        except Exception as error:  # noqa: BLE001 - deliberate: one case's crash is its result line, the lane goes on
            got = [Line(f"{name}: failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                        "failed")]
        for line in got:
            print(line.text, flush=True)
        lines += got
        lines.append(Line(f"  ({name}: {time.perf_counter() - case_start:.0f} s)", "time"))
        command = " ".join(sys.argv[1:] if argv is None else argv)
        write_report(out, head, lines, f".venv/bin/python -m benchmarks.gpu {command}")
    counts = {s: sum(line.status == s for line in lines) for s in ("ok", "skipped", "failed")}
    print(f"result: {len(names)} cases, {counts['ok']} results, {counts['skipped']} skipped, {counts['failed']} failed "
          f"in {(time.perf_counter() - start) / 60:.1f} min; report in {out}", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
