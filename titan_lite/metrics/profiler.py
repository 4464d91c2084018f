"""torch.profiler Chrome traces and CUDA allocator memory snapshots, taken every `profile_freq` steps."""

import contextlib
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from titan_lite.config import JobConfig

logger = logging.getLogger("titan_lite.metrics")

MEMORY_HISTORY_MAX_ENTRIES = 100_000
_warned_snapshot_needs_cuda = False


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def profiler_windows(profile_freq: int, warmup: int, active: int) -> tuple[int, int, int]:
    """(wait, warmup, active) filling one `profile_freq`-step cycle; shrinks warmup, then active, to fit (warning)."""
    fitted_active = max(1, min(active, profile_freq))
    fitted_warmup = max(0, min(warmup, profile_freq - fitted_active))
    if (fitted_warmup, fitted_active) != (warmup, active):
        logger.warning("profiling.profile_freq=%d is too small for profiler_warmup=%d + profiler_active=%d; "
                       "using warmup=%d, active=%d", profile_freq, warmup, active, fitted_warmup, fitted_active)
    return profile_freq - fitted_active - fitted_warmup, fitted_warmup, fitted_active


def _profiler_activities() -> list[torch.profiler.ProfilerActivity]:
    """CPU, plus the current accelerator's activity when the profiler knows it (CUDA covers ROCm too)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None:
        activity = getattr(torch.profiler.ProfilerActivity, accelerator.type.upper(), None)
        if activity is not None:
            activities.append(activity)
    return activities


def _trace_writer(trace_dir: str, rank: int) -> Callable[[torch.profiler.profile], None]:
    def write_trace(prof: torch.profiler.profile) -> None:
        folder = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        start = time.perf_counter()
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_trace.json"))
        logger.info("Profiler trace of step %d written to %s in %.2f s", prof.step_num, folder,
                    time.perf_counter() - start)

    return write_trace


@contextlib.contextmanager
def maybe_enable_profiling(cfg: JobConfig, global_step: int = 0) -> Iterator[torch.profiler.profile | None]:
    """Yield a torch profiler whose `.step()` the trainer calls after every step, or None when profiling is off.

    Each `profile_freq`-step cycle records its last `profiler_active` steps (after `profiler_warmup` warm-up
    steps) and writes {dump_folder}/{save_traces_folder}/iteration_{N}/rank{r}_trace.json, N being the step
    count when the window closed. `global_step` is the step resumed from, so windows stay aligned.
    """
    if not cfg.profiling.enable_profiling:
        yield None
        return
    p = cfg.profiling
    wait, warmup, active = profiler_windows(p.profile_freq, p.profiler_warmup, p.profiler_active)
    trace_dir = os.path.join(cfg.job.dump_folder, p.save_traces_folder)
    logger.info("Profiling every %d steps (wait %d, warmup %d, active %d) into %s", p.profile_freq, wait, warmup,
                active, trace_dir)
    with torch.profiler.profile(
        activities=_profiler_activities(),
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active),
        on_trace_ready=_trace_writer(trace_dir, _rank()),
        record_shapes=True,
    ) as prof:
        prof.step_num = global_step
        yield prof


class MemorySnapshotter:
    """Counts steps and dumps an allocator snapshot every `freq` steps (and on demand when leaving early)."""

    def __init__(self, folder: str, rank: int, freq: int, start_step: int, dump: Callable[[str], None]):
        self.folder = folder
        self.rank = rank
        self.freq = freq
        self.step_num = start_step
        self.dump = dump

    def step(self, exit_ctx: bool = False) -> None:
        """Call after every step; `exit_ctx=True` (e.g. on OOM) dumps now into iteration_{N}_exit."""
        if not exit_ctx:
            self.step_num += 1
            if self.step_num % self.freq != 0:
                return
        name = f"iteration_{self.step_num}" + ("_exit" if exit_ctx else "")
        folder = os.path.join(self.folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        self.dump(path)
        logger.info("Memory snapshot written to %s", path)


def _dump_cuda_snapshot(path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)


@contextlib.contextmanager
def maybe_enable_memory_snapshot(cfg: JobConfig, global_step: int = 0) -> Iterator[MemorySnapshotter | None]:
    """On CUDA, record allocator history and yield a MemorySnapshotter; otherwise yield None.

    Snapshots go to {dump_folder}/{save_memory_snapshot_folder}/iteration_{N}/rank{r}_memory_snapshot.pickle
    every profile_freq steps (open them at pytorch.org/memory_viz). Without CUDA this logs once and does nothing.
    """
    global _warned_snapshot_needs_cuda
    if not cfg.profiling.enable_memory_snapshot:
        yield None
        return
    if not torch.cuda.is_available():
        if not _warned_snapshot_needs_cuda:
            logger.warning("profiling.enable_memory_snapshot needs CUDA (the CUDA caching allocator); ignored")
            _warned_snapshot_needs_cuda = True
        yield None
        return
    folder = os.path.join(cfg.job.dump_folder, cfg.profiling.save_memory_snapshot_folder)
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES)
    try:
        yield MemorySnapshotter(folder, _rank(), cfg.profiling.profile_freq, global_step, _dump_cuda_snapshot)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
