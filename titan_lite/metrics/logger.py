"""Training metrics: the `titan_lite` console logger, the per-window throughput/MFU/memory report and the writers
it feeds (TensorBoard, W&B)."""

import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_lite.config import JobConfig
from titan_lite.launcher import STDOUT_IS_TTY_ENV
from titan_lite.metrics.flops import peak_flops
from titan_lite.metrics.memory import device_capacity_gib, peak_memory_gib, reset_peak
from titan_lite.metrics.wandb_writer import WandbWriter

LOGGER_NAME = "titan_lite"
LOG_FORMAT = "[titan_lite] %(asctime)s %(levelname)s %(message)s"

logger = logging.getLogger(LOGGER_NAME)


class _StdoutHandler(logging.StreamHandler):
    """A handler that writes to whatever sys.stdout is at emit time, so redirections and pytest capture see it."""

    _titan_lite = True

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def init_logger() -> None:
    """Make the `titan_lite` logger print INFO and up as "[titan_lite] <time> <level> message" on stdout, once."""
    if not any(getattr(h, "_titan_lite", False) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler configured by someone else would print every line twice


_ANSI = re.compile(r"\033\[[0-9;]*m")


class _PlainFormatter(logging.Formatter):
    """The console format without colour codes: a log file is read with less, grep and editors."""

    def format(self, record: logging.LogRecord) -> str:
        return _ANSI.sub("", super().format(record))


def add_log_file(path: str | Path) -> Path:
    """Also write the `titan_lite` log to `path` (appending: a resumed run continues the same file), line by line,
    so that the last lines before a Ctrl-C or a crash are there even when the console went through a pipe."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for handler in [h for h in logger.handlers if getattr(h, "_titan_lite_file", False)]:
        logger.removeHandler(handler)
        handler.close()
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler._titan_lite_file = True
    handler.setFormatter(_PlainFormatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    return path


def format_duration(seconds: float) -> str:
    """1h02m, 3m07s, 42s."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """Lines for a long phase (generation, a validation pass): one when it starts (`announce`), then at most one
    every `every_s` seconds with the count done, the elapsed time and an ETA, so no phase is silent for long."""

    def __init__(self, what: str, total: int, unit: str, every_s: float = 10.0, announce: bool = False):
        self.what, self.total, self.unit, self.every_s = what, total, unit, every_s
        self.start = self.last = time.perf_counter()
        if announce:
            logger.info(f"{what}: {total} {unit}")

    def update(self, done: float) -> None:
        """`done` may count a unit in progress by its share (a batch of completions halfway through decoding)."""
        now = time.perf_counter()
        if now - self.last < self.every_s or done >= self.total or done <= 0:
            return
        self.last = now
        elapsed = now - self.start
        eta = format_duration(elapsed / done * (self.total - done))
        logger.info(f"{self.what}: {int(done)}/{self.total} {self.unit} in {format_duration(elapsed)}, eta {eta}")


@dataclass(frozen=True)
class Colors:
    red: str = "\033[31m"
    green: str = "\033[32m"
    yellow: str = "\033[33m"
    blue: str = "\033[34m"
    magenta: str = "\033[35m"
    cyan: str = "\033[36m"
    reset: str = "\033[39m"


NO_COLORS = Colors(*([""] * 7))


def stdout_is_terminal() -> bool:
    """Whether this process's output reaches a terminal. Under run_train.sh a rank's stdout is torchrun's pipe, so
    the launcher says whether its own stdout is a terminal."""
    told = os.environ.get(STDOUT_IS_TTY_ENV)
    return told == "1" if told is not None else sys.stdout.isatty()


def colors_for(cfg: JobConfig) -> Colors:
    """ANSI colours only on a terminal (never in a log file or pipe) and unless metrics.disable_color_printing."""
    return Colors() if stdout_is_terminal() and not cfg.metrics.disable_color_printing else NO_COLORS


def metrics_dir(cfg: JobConfig, rank: int) -> str | None:
    """Where `rank` writes its scalars (TensorBoard events, the W&B run folder), or None when it writes none: rank 0,
    or every rank in its own rank_N folder with metrics.save_for_all_ranks."""
    if not (cfg.metrics.enable_tensorboard or cfg.metrics.enable_wandb):
        return None
    base = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
    if cfg.metrics.save_for_all_ranks:
        return os.path.join(base, f"rank_{rank}")
    return base if rank == 0 else None


class TensorBoardWriter:
    """Scalars to TensorBoard event files, flushed at every logged step."""

    def __init__(self, folder: str):
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: it pulls in tensorboard

        self.writer = SummaryWriter(log_dir=folder)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ScalarWriters:
    """The one place logged scalars fan out from: TensorBoard and W&B, each when enabled, both at once."""

    def __init__(self, cfg: JobConfig, rank: int, resuming: bool = False):
        folder = metrics_dir(cfg, rank)
        self.writers = []
        if folder is not None and cfg.metrics.enable_tensorboard:
            self.writers.append(TensorBoardWriter(folder))
        if folder is not None and cfg.metrics.enable_wandb:
            self.writers.append(WandbWriter(cfg, folder, resuming))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for writer in self.writers:
            writer.write(step, scalars)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


class MetricsProcessor:
    """Accumulates tokens between logs and reports loss, throughput, MFU and memory every `log_freq` steps."""

    def __init__(self, cfg: JobConfig, rank: int, device: torch.device, num_flops_per_token: float,
                 tokens_divisor: int = 1, resuming: bool = False):
        # tokens_divisor: the non-data-parallel degree (tp * pp * cp). Those ranks consume the same tokens,
        # so dividing by it makes tokens/s a per-device number, as torchtitan reports it. resuming: the run
        # continues from its checkpoint (its W&B run continues too).
        init_logger()
        self.log_freq = cfg.metrics.log_freq
        self.total_steps = cfg.training.steps
        self.colors = colors_for(cfg)
        self.device = device
        self.num_flops_per_token = num_flops_per_token
        self.tokens_divisor = tokens_divisor
        self.peak_flops = peak_flops(device)  # before the clock starts: on CPU it is measured
        self.capacity_gib = device_capacity_gib(device)
        self.writers = ScalarWriters(cfg, rank, resuming)
        self.ntokens_since_last_log = 0
        self.last_log_step = 0
        reset_peak(device)
        self.time_last_log = time.perf_counter()

    def should_log(self, step: int) -> bool:
        """Step 1 and every `log_freq`-th step are logged."""
        return step == 1 or step % self.log_freq == 0

    def add_tokens(self, ntokens: int) -> None:
        """Count the tokens this rank consumed this step."""
        self.ntokens_since_last_log += ntokens

    def _throughput(self, step: int) -> dict[str, float]:
        elapsed = time.perf_counter() - self.time_last_log
        steps = max(step - self.last_log_step, 1)
        tps = self.ntokens_since_last_log / (elapsed * self.tokens_divisor) if elapsed > 0 else 0.0
        achieved_flops = self.num_flops_per_token * tps
        if achieved_flops > self.peak_flops:
            self._raise_peak(achieved_flops)
        return {
            "throughput/tps": tps,
            "throughput/tflops": achieved_flops / 1e12,
            "throughput/mfu_pct": 100 * achieved_flops / self.peak_flops,
            "time/step_s": elapsed / steps,
        }

    def _raise_peak(self, achieved: float) -> None:
        """Training ran faster than the peak MFU is measured against (a CPU's measured matmul rate, or a datasheet
        peak under float8): that rate is the new peak, so MFU stays a fraction of what the device reached."""
        logger.warning(f"training ran at {achieved / 1e9:,.1f} GFLOP/s, above the peak MFU was measured against "
                       f"({self.peak_flops / 1e9:,.1f} GFLOP/s): MFU is against {achieved / 1e9:,.1f} GFLOP/s from "
                       "here on")
        self.peak_flops = achieved

    def _memory(self) -> dict[str, float]:
        active_gib, reserved_gib = peak_memory_gib(self.device)
        memory = {"memory/max_active_gib": active_gib, "memory/max_reserved_gib": reserved_gib}
        if self.capacity_gib:
            memory["memory/max_active_pct"] = 100 * active_gib / self.capacity_gib
            memory["memory/max_reserved_pct"] = 100 * reserved_gib / self.capacity_gib
        return memory

    def _format_line(self, step: int, m: dict[str, float], extra: dict[str, float]) -> str:
        c = self.colors
        memory = f"{m['memory/max_active_gib']:.2f}GiB"
        if "memory/max_active_pct" in m:
            memory += f"({m['memory/max_active_pct']:.2f}%)"
        eta = format_duration(m["time/step_s"] * (self.total_steps - step))
        line = (f"{c.red}step: {step:2}/{self.total_steps}  {c.green}loss: {m['loss/global_avg']:7.4f}  "
                f"grad_norm: {m['grad_norm']:7.4f}  lr: {m['lr']:.1e}  "
                f"{c.blue}tps: {m['throughput/tps']:,.0f}  {c.cyan}tflops: {m['throughput/tflops']:,.2f}  "
                f"{c.magenta}mfu: {m['throughput/mfu_pct']:.2f}%  {c.yellow}memory: {memory}")
        line += "".join(f"  {name}: {value:.4g}" for name, value in extra.items())
        return line + f"  eta: {eta}" + c.reset

    def _write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.writers.write(step, scalars)

    def start_window(self, step: int) -> None:
        """Measure from here on, as after step `step`: the trainer calls it when the loop starts (after a resume, the
        step it resumed from), so the first line's time per step, throughput and ETA cover only steps that ran."""
        self.ntokens_since_last_log = 0
        self.last_log_step = step
        reset_peak(self.device)
        self.time_last_log = time.perf_counter()

    def log(self, step: int, loss: float, grad_norm: float, lr: float,
            extra: dict[str, float] | None = None, unprinted: dict[str, float] | None = None) -> dict[str, float]:
        """Report the window since the previous log: print one line, write TensorBoard, return the scalars;
        `unprinted` scalars (one per layer, say) go to TensorBoard only."""
        extra = dict(extra or {})
        metrics = {"loss/global_avg": float(loss), "grad_norm": float(grad_norm), "lr": float(lr)}
        metrics |= self._throughput(step)
        metrics |= self._memory()
        metrics |= {name: float(value) for name, value in {**extra, **(unprinted or {})}.items()}
        logger.info(self._format_line(step, metrics, extra))
        self._write_scalars(step, metrics)
        self.start_window(step)
        return metrics

    def log_validation(self, step: int, loss: float | None, extra: dict[str, float] | None = None) -> None:
        """Print and record the validation loss (None: none, RL prompts) and any further validation metrics
        (token_accuracy, ...)."""
        c = self.colors
        extra = extra or {}
        more = "".join(f"  {c.blue}{name}: {value:.4f}" for name, value in extra.items())
        measured = f"  {c.green}loss: {float(loss):7.4f}" if loss is not None else ""
        logger.info(f"{c.yellow}validate step: {step:2}{measured}{more}{c.reset}")
        self._write_scalars(step, {**({"validation/loss": float(loss)} if loss is not None else {}),
                                   **{f"validation/{name}": float(value) for name, value in extra.items()}})

    def close(self) -> None:
        """Flush and close the TensorBoard and W&B writers."""
        self.writers.close()
