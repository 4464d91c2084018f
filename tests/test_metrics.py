"""Tests for titan_lite.metrics: FLOP counts, peak FLOP/s, memory readings, the metrics processor, profiling."""

import json
import logging
import os
import re
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from titan_lite.config import parse_args
from titan_lite.launcher import STDOUT_IS_TTY_ENV
from titan_lite.metrics import flops as flops_mod
from titan_lite.metrics import logger as logger_mod
from titan_lite.metrics import profiler as profiler_mod
from titan_lite.metrics.flops import gpu_peak_flops_by_name, num_flops_per_token, peak_flops
from titan_lite.metrics.logger import MetricsProcessor, init_logger
from titan_lite.metrics.memory import device_capacity_gib, peak_memory_gib, reset_peak
from titan_lite.metrics.profiler import (
    MemorySnapshotter,
    maybe_enable_memory_snapshot,
    maybe_enable_profiling,
    profiler_windows,
)

CPU = torch.device("cpu")
ANSI = re.compile(r"\033\[[0-9;]*m")


class Records(logging.Handler):
    """Collects the formatted messages of the titan_lite logger tree."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records():
    handler = Records()
    init_logger()
    logging.getLogger("titan_lite").addHandler(handler)
    yield handler
    logging.getLogger("titan_lite").removeHandler(handler)


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(logger_mod.time, "perf_counter", fake)
    return fake


@pytest.fixture
def fixed_hw(monkeypatch):
    """Peak FLOP/s of 1e12 and a peak memory of (0.45, 0.5) GiB, so every logged number is predictable."""
    monkeypatch.setattr(logger_mod, "peak_flops", lambda device: 1e12)
    monkeypatch.setattr(logger_mod, "peak_memory_gib", lambda device: (0.45, 0.5))


def make_cfg(tmp_path, *args: str):
    return parse_args(["--job.dump_folder", str(tmp_path), *args])


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def event_files(folder) -> list[str]:
    return [f for f in os.listdir(folder) if f.startswith("events.out.tfevents")]


# ---------------------------------------------------------------- flops


def test_num_flops_per_token_llama3_8b():
    # 6 * (8,030,261,248 - 525,336,576) = 45,029,548,032 ; 12 * 32 * 32 * 128 * 8192 = 12,884,901,888
    got = num_flops_per_token(8_030_261_248, 525_336_576, n_layers=32, n_heads=32, head_dim=128, seq_len=8192)
    assert got == 45_029_548_032 + 12_884_901_888 == 57_914_449_920


def test_num_flops_per_token_tied_embeddings_keep_the_output_matmul():
    assert num_flops_per_token(1000, 0, n_layers=2, n_heads=4, head_dim=8, seq_len=16) == 6 * 1000 + 12 * 2 * 4 * 8 * 16
    assert num_flops_per_token(1000, 200, 2, 4, 8, 16) == 6 * 800 + 12 * 2 * 4 * 8 * 16


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A10G", 125e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA GeForce RTX 4090", 165.2e12),
    ("NVIDIA B200", 2.25e15),
    ("AMD Instinct MI300X", 1307.4e12),
])
def test_gpu_peak_flops_table(name, expected):
    assert gpu_peak_flops_by_name(name) == expected


def test_unknown_gpu_warns_and_uses_a100(records):
    assert gpu_peak_flops_by_name("Mystery Accelerator 9000") == 312e12
    assert any("Mystery Accelerator 9000" in m for m in records.messages)


def test_peak_flops_on_cuda_looks_up_the_device_name(monkeypatch):
    monkeypatch.setattr(flops_mod.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda", 0)) == 756e12


def test_cpu_peak_flops_is_measured_sane_and_cached(monkeypatch):
    measured = peak_flops(CPU)
    assert 1e8 <= measured <= 1e13

    def no_matmul(*args, **kwargs):
        raise AssertionError("the CPU peak must come from the per-process cache")

    monkeypatch.setattr(flops_mod.torch, "mm", no_matmul)
    assert peak_flops(CPU) == measured


# ---------------------------------------------------------------- memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_cpu_peak_memory_is_the_process_peak_rss():
    active, reserved = peak_memory_gib(CPU)
    status = open("/proc/self/status").read()
    hwm_kib = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
    assert active == reserved
    assert active == pytest.approx(hwm_kib / 2**20, abs=16 / 1024)  # within 16 MiB of the kernel's high-water mark
    reset_peak(CPU)  # a no-op on CPU: the peak cannot go down
    assert peak_memory_gib(CPU)[0] >= active
    assert device_capacity_gib(CPU) is None


def test_accelerator_memory_reads_allocator_stats(monkeypatch):
    gib = 1024**3
    resets = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "active_bytes.all.peak": 3 * gib, "allocated_bytes.all.peak": 2 * gib, "reserved_bytes.all.peak": 4 * gib})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("Props", (), {"total_memory": 80 * gib})())
    cuda = torch.device("cuda", 0)
    assert peak_memory_gib(cuda) == (3.0, 4.0)  # active (not allocated) is the peak reported
    assert device_capacity_gib(cuda) == 80.0
    reset_peak(cuda)
    assert resets == [cuda]


# ---------------------------------------------------------------- metrics processor


def test_should_log(tmp_path):
    mp = MetricsProcessor(make_cfg(tmp_path, "--metrics.log_freq", "5"), 0, CPU, 1.0)
    assert [s for s in range(1, 21) if mp.should_log(s)] == [1, 5, 10, 15, 20]


def test_mfu_and_throughput_arithmetic(tmp_path, clock, fixed_hw):
    mp = MetricsProcessor(make_cfg(tmp_path), 0, CPU, num_flops_per_token=6e6, tokens_divisor=2)
    for _ in range(10):
        mp.add_tokens(4096)
    clock.now = 102.0
    m = mp.log(10, loss=5.0, grad_norm=1.0, lr=1e-3)
    # 40,960 tokens / (2 s * 2 non-DP ranks) = 10,240 tok/s; * 6e6 FLOP/token = 6.144e10 FLOP/s
    assert m["throughput/tps"] == pytest.approx(10_240.0, rel=1e-12)
    assert m["throughput/tflops"] == pytest.approx(0.06144, rel=1e-12)
    assert m["throughput/mfu_pct"] == pytest.approx(6.144, rel=1e-12)  # 6.144e10 / 1e12 peak
    assert m["time/step_s"] == pytest.approx(0.2, rel=1e-12)
    assert m["memory/max_active_gib"] == 0.45 and m["memory/max_reserved_gib"] == 0.5
    assert "memory/max_active_pct" not in m  # no capacity on CPU

    # the next window only counts what happened after the previous log
    for _ in range(10):
        mp.add_tokens(1000)
    clock.now = 106.0
    m = mp.log(20, loss=4.0, grad_norm=1.0, lr=1e-3)
    assert m["throughput/tps"] == pytest.approx(10_000 / (4.0 * 2), rel=1e-12)
    assert m["throughput/mfu_pct"] == pytest.approx(100 * 6e6 * 1250 / 1e12, rel=1e-12)
    assert m["time/step_s"] == pytest.approx(0.4, rel=1e-12)


def test_mfu_never_reads_above_100_percent_of_a_peak_training_outran(tmp_path, clock, fixed_hw, records):
    """A measured peak is a lower bound: 40,960 tokens in 2 s at 6e7 FLOP/token is 1.2288e12 FLOP/s, above the
    1e12 peak, so that rate becomes the peak (100%) and a slower window is measured against it."""
    mp = MetricsProcessor(make_cfg(tmp_path, "--metrics.disable_color_printing"), 0, CPU, num_flops_per_token=6e7)
    mp.add_tokens(40_960)
    clock.now = 102.0
    assert mp.log(1, loss=5.0, grad_norm=1.0, lr=1e-3)["throughput/mfu_pct"] == pytest.approx(100.0)
    assert records.messages[-2] == ("training ran at 1,228.8 GFLOP/s, above the peak MFU was measured against "
                                    "(1,000.0 GFLOP/s): MFU is against 1,228.8 GFLOP/s from here on")
    assert "mfu: 100.00%" in records.messages[-1]
    mp.add_tokens(20_480)
    clock.now = 104.0
    assert mp.log(2, loss=5.0, grad_norm=1.0, lr=1e-3)["throughput/mfu_pct"] == pytest.approx(50.0)


def test_the_cpu_peak_is_the_fastest_matmul_size(monkeypatch):
    rates = {256: 9e10, 512: 1e11, 1024: 3e10}  # as measured on an AVX-512 core: 1024 falls out of cache
    monkeypatch.setattr(flops_mod, "_measure_matmul_flops", lambda device, dtype, size, reps: rates[size])
    assert flops_mod._measure_peak(CPU, torch.float32) == 1e11


def test_the_first_line_after_a_resume_measures_only_the_steps_that_ran(tmp_path, clock, fixed_hw, records):
    """Resumed after step 432 of 600, logging every 10: the line at step 440 covers steps 433-440 (8 steps in 8 s),
    so time/step_s is 1 s and the ETA the 160 steps left, 2m40s (not 8 s over 440 steps, eta 3s)."""
    mp = MetricsProcessor(make_cfg(tmp_path, "--metrics.disable_color_printing", "--training.steps", "600"), 0, CPU,
                          num_flops_per_token=6e6)
    clock.now = 250.0  # building the model and loading the checkpoint took a while
    mp.start_window(432)
    for _ in range(8):
        mp.add_tokens(4096)
    clock.now = 258.0
    m = mp.log(440, loss=5.0, grad_norm=1.0, lr=1e-3)
    assert m["time/step_s"] == pytest.approx(1.0) and m["throughput/tps"] == pytest.approx(4096.0)
    assert records.messages[-1].startswith("step: 440/600  ") and records.messages[-1].endswith("eta: 2m40s")


def test_console_line_plain(tmp_path, clock, fixed_hw, records):
    mp = MetricsProcessor(make_cfg(tmp_path, "--metrics.disable_color_printing"), 0, CPU, num_flops_per_token=6e6,
                          tokens_divisor=2)
    for _ in range(10):
        mp.add_tokens(4096)
    clock.now = 102.0
    mp.log(10, loss=5.12341, grad_norm=1.23449, lr=8e-4)
    assert records.messages[-1] == ("step: 10/10000  loss:  5.1234  grad_norm:  1.2345  lr: 8.0e-04  tps: 10,240  "
                                    "tflops: 0.06  mfu: 6.14%  memory: 0.45GiB  eta: 33m18s")  # 9990 x 0.2 s
    mp.log_validation(10, 4.56789)
    assert records.messages[-1] == "validate step: 10  loss:  4.5679"


def test_console_line_coloured_and_extras(tmp_path, clock, fixed_hw, records, monkeypatch):
    monkeypatch.setenv(STDOUT_IS_TTY_ENV, "1")  # the launcher says its output is a terminal
    mp = MetricsProcessor(make_cfg(tmp_path), 0, CPU, num_flops_per_token=6e6)
    mp.add_tokens(1000)
    clock.now = 101.0
    mp.log(1, loss=2.5, grad_norm=0.5, lr=1e-4, extra={"loss/ntokens": 1000})
    line = records.messages[-1]
    assert "\033[" in line
    assert ANSI.sub("", line) == ("step:  1/10000  loss:  2.5000  grad_norm:  0.5000  lr: 1.0e-04  tps: 1,000  "
                                  "tflops: 0.01  mfu: 0.60%  memory: 0.45GiB  loss/ntokens: 1000  eta: 2h46m")


@pytest.mark.parametrize("told, isatty, disabled, coloured", [
    ("0", True, False, False),  # a launched rank whose launcher writes to a file or pipe
    ("1", False, False, True),  # a launched rank whose launcher writes to a terminal
    ("1", False, True, False),  # metrics.disable_color_printing
    (None, False, False, False),  # a plain process writing to a file
    (None, True, False, True),  # a plain process on a terminal
])
def test_colours_only_on_a_terminal(tmp_path, monkeypatch, told, isatty, disabled, coloured):
    if told is None:
        monkeypatch.delenv(STDOUT_IS_TTY_ENV, raising=False)
    else:
        monkeypatch.setenv(STDOUT_IS_TTY_ENV, told)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: isatty, raising=False)
    cfg = make_cfg(tmp_path, *(["--metrics.disable_color_printing"] if disabled else []))
    assert (logger_mod.colors_for(cfg) != logger_mod.NO_COLORS) == coloured


def test_console_line_shows_memory_share_on_accelerators(tmp_path, clock, fixed_hw, records, monkeypatch):
    monkeypatch.setattr(logger_mod, "device_capacity_gib", lambda device: 16.0)
    mp = MetricsProcessor(make_cfg(tmp_path, "--metrics.disable_color_printing"), 0, CPU, num_flops_per_token=6e6)
    clock.now = 101.0
    m = mp.log(1, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert m["memory/max_active_pct"] == pytest.approx(100 * 0.45 / 16)
    assert m["memory/max_reserved_pct"] == pytest.approx(100 * 0.5 / 16)
    assert records.messages[-1].endswith("memory: 0.45GiB(2.81%)  eta: 2h46m")


def test_init_logger_format_and_idempotence(capsys):
    init_logger()
    init_logger()
    assert sum(getattr(h, "_titan_lite", False) for h in logging.getLogger("titan_lite").handlers) == 1
    logging.getLogger("titan_lite.some_module").info("hello %d", 42)
    out = capsys.readouterr().out
    assert re.fullmatch(r"\[titan_lite\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO hello 42\n", out)


def test_tensorboard_scalars_round_trip(tmp_path, clock, fixed_hw):
    cfg = make_cfg(tmp_path, "--metrics.enable_tensorboard", "--metrics.log_freq", "10")
    mp = MetricsProcessor(cfg, 0, CPU, num_flops_per_token=6e6)
    expected_loss = {}
    for step in range(1, 21):
        mp.add_tokens(500)
        clock.now += 0.5
        if mp.should_log(step):
            loss = 10.0 / step
            expected_loss[step] = loss
            mp.log(step, loss=loss, grad_norm=step / 10, lr=step * 1e-4, extra={"custom/x": step * 2})
    mp.log_validation(20, 3.25)
    mp.close()

    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["loss/global_avg"]] == [1, 10, 20]
    assert [v for _, v in scalars["loss/global_avg"]] == pytest.approx(list(expected_loss.values()), rel=1e-6)
    assert scalars["grad_norm"] == [(s, pytest.approx(s / 10, rel=1e-6)) for s in (1, 10, 20)]
    assert scalars["lr"] == [(s, pytest.approx(s * 1e-4, rel=1e-6)) for s in (1, 10, 20)]
    assert scalars["custom/x"] == [(1, 2.0), (10, 20.0), (20, 40.0)]
    # windows: step 1 = 500 tokens in 0.5 s; steps 2-10 = 4500 in 4.5 s; steps 11-20 = 5000 in 5 s -> 1000 tok/s
    assert scalars["throughput/tps"] == [(s, pytest.approx(1000.0, rel=1e-6)) for s in (1, 10, 20)]
    assert scalars["throughput/mfu_pct"] == [(s, pytest.approx(0.6, rel=1e-6)) for s in (1, 10, 20)]
    assert scalars["time/step_s"] == [(s, pytest.approx(0.5, rel=1e-6)) for s in (1, 10, 20)]
    assert scalars["memory/max_active_gib"] == [(s, pytest.approx(0.45, rel=1e-6)) for s in (1, 10, 20)]
    assert scalars["validation/loss"] == [(20, 3.25)]


def test_tensorboard_rank0_only_by_default(tmp_path, fixed_hw):
    cfg = make_cfg(tmp_path, "--metrics.enable_tensorboard")
    for rank in (0, 1):
        mp = MetricsProcessor(cfg, rank, CPU, 1.0)
        mp.log(1, loss=float(rank + 1), grad_norm=0.0, lr=0.0)
        mp.close()
    assert len(event_files(tmp_path / "tb")) == 1
    assert sorted(os.listdir(tmp_path / "tb")) == event_files(tmp_path / "tb")  # no rank_N folders
    assert read_scalars(tmp_path / "tb")["loss/global_avg"] == [(1, 1.0)]


def test_tensorboard_save_for_all_ranks(tmp_path, fixed_hw):
    cfg = make_cfg(tmp_path, "--metrics.enable_tensorboard", "--metrics.save_for_all_ranks")
    for rank in (0, 1):
        mp = MetricsProcessor(cfg, rank, CPU, 1.0)
        mp.log(1, loss=float(rank + 1), grad_norm=0.0, lr=0.0)
        mp.close()
    assert sorted(os.listdir(tmp_path / "tb")) == ["rank_0", "rank_1"]
    assert read_scalars(tmp_path / "tb" / "rank_0")["loss/global_avg"] == [(1, 1.0)]
    assert read_scalars(tmp_path / "tb" / "rank_1")["loss/global_avg"] == [(1, 2.0)]


def test_tensorboard_disabled_writes_nothing(tmp_path, fixed_hw):
    mp = MetricsProcessor(make_cfg(tmp_path), 0, CPU, 1.0)
    mp.log(1, loss=1.0, grad_norm=0.0, lr=0.0)
    mp.close()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- profiling


def run_profiled_steps(cfg, steps: int, global_step: int = 0) -> None:
    a = torch.randn(64, 64)
    with maybe_enable_profiling(cfg, global_step=global_step) as prof:
        for _ in range(steps):
            torch.mm(a, a)
            prof.step()


def load_trace(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_profiler_writes_a_chrome_trace(tmp_path):
    cfg = make_cfg(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq", "4",
                   "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1")
    run_profiled_steps(cfg, 4)
    trace_root = tmp_path / "profile_trace"
    assert os.listdir(trace_root) == ["iteration_4"]
    trace = load_trace(trace_root / "iteration_4" / "rank0_trace.json")
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names
    assert "ProfilerStep#3" in names  # the active step: the 4th, counted from 0
    assert "ProfilerStep#2" not in names  # the warm-up step is not saved


def test_profiler_resumes_aligned_with_global_step(tmp_path):
    cfg = make_cfg(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq", "3",
                   "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1")
    run_profiled_steps(cfg, 3, global_step=6)
    assert os.listdir(tmp_path / "profile_trace") == ["iteration_9"]


def test_profiler_clamps_windows_longer_than_the_cycle(tmp_path, records):
    assert profiler_windows(10, 3, 1) == (6, 3, 1)
    assert profiler_windows(2, 3, 1) == (0, 1, 1)
    assert profiler_windows(2, 0, 5) == (0, 0, 2)
    assert sum("too small" in m for m in records.messages) == 2
    cfg = make_cfg(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq", "2",
                   "--profiling.profiler_warmup", "3", "--profiling.profiler_active", "1")
    run_profiled_steps(cfg, 2)
    assert "traceEvents" in load_trace(tmp_path / "profile_trace" / "iteration_2" / "rank0_trace.json")


def test_profiling_disabled_yields_none(tmp_path):
    with maybe_enable_profiling(make_cfg(tmp_path)) as prof:
        assert prof is None
    with maybe_enable_memory_snapshot(make_cfg(tmp_path, "--profiling.enable_memory_snapshot", "false")) as snap:
        assert snap is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_memory_snapshot_without_cuda_warns_once(tmp_path, records, monkeypatch):
    monkeypatch.setattr(profiler_mod, "_warned_snapshot_needs_cuda", False)
    cfg = make_cfg(tmp_path, "--profiling.enable_memory_snapshot")
    for _ in range(2):
        with maybe_enable_memory_snapshot(cfg, 0) as snap:
            assert snap is None
    assert sum("needs CUDA" in m for m in records.messages) == 1
    assert os.listdir(tmp_path) == []


def test_memory_snapshotter_dumps_every_freq_steps(tmp_path):
    dumped = []
    snap = MemorySnapshotter(str(tmp_path), rank=3, freq=3, start_step=2, dump=dumped.append)
    for _ in range(7):  # steps 3..9
        snap.step()
    snap.step(exit_ctx=True)
    rel = [os.path.relpath(p, tmp_path) for p in dumped]
    assert rel == [os.path.join(f"iteration_{n}", "rank3_memory_snapshot.pickle") for n in (3, 6, 9)] + [
        os.path.join("iteration_9_exit", "rank3_memory_snapshot.pickle")]
    assert all(os.path.isdir(os.path.dirname(p)) for p in dumped)
