"""The benchmarks' framework: a case is a named comparison of variants, each run alternately in fresh processes
(benchmarks/run.py runs them). A variant knows the command that measures it and how to read that command's output
(RunOutput) into metrics; a case names its variants and the ratios to report. The catalogue of cases is
benchmarks/cases.py; the variants it uses are benchmarks/variants.py.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.worker import RESULT_PREFIX

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RunOutput:
    """What one measurement printed, how long it took and its own peak RSS (from wait4)."""

    stdout: str
    returncode: int
    wall_s: float
    child_cpu_s: float
    child_peak_rss_bytes: int


@dataclass
class Settings:
    """Options of one benchmark invocation that shape the variants' commands."""

    steps: int = 5
    warmup: int = 2
    threads: int = 2  # CPU threads in all: one process uses them all, N processes share them


@dataclass
class Variant:
    """One side of a comparison: a command and a reading of its output."""

    label: str

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def metrics(self, out: RunOutput) -> dict[str, float]:
        raise NotImplementedError


def worker_results(stdout: str) -> list[dict]:
    try:
        return [json.loads(line[len(RESULT_PREFIX):]) for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    except json.JSONDecodeError as exc:  # a failed run, not a crash of the whole benchmark
        raise RuntimeError(f"unreadable result line ({exc})\n{stdout[-3000:]}") from exc


def single_result(label: str, out: RunOutput) -> dict:
    """The one result line of a single-process worker run; a failed run raises with the end of its output."""
    result = worker_results(out.stdout)
    if out.returncode != 0 or not result:
        raise RuntimeError(f"{label}: exit code {out.returncode}\n{out.stdout[-3000:]}")
    return result[0]


def foreign_cores(r: dict) -> float:
    """Cores busy with other processes over a worker's timed work, on average."""
    busy = r["machine_busy_s"]
    return (busy - r["own_cpu_s"]) / r["wall_s"] if busy is not None else 0.0


@dataclass
class Ratio:
    """numerator's metric over denominator's (labels of variants in the same case)."""

    label: str
    metric: str
    numerator: str
    denominator: str
    target: float | None = None
    higher_is_better: bool = True
    denominator_metric: str | None = None  # the denominator's metric, when not `metric` (e.g. a floor)


@dataclass
class Case:
    name: str
    description: str
    variants: list[Variant]
    ratios: list[Ratio] = field(default_factory=list)
    columns: tuple[str, ...] = ("tokens_per_s", "mfu_pct", "step_s", "peak_rss_gib")
    # At least this many rounds whatever --repeats says: for cases of seconds-long runs, whose ratios the machine's
    # minute-to-minute speed changes would otherwise decide (see BENCHMARKS.md: the matmul rate measured before each
    # round varies by up to 2x on the development VM).
    min_rounds: int = 1
    # At most this many rounds (None: --repeats): for cases that alternate their variants inside one run already.
    max_rounds: int | None = None


def environment_of(variant: Variant, settings: Settings) -> tuple[list[str], dict[str, str]]:
    argv, env = variant.command(settings)
    full = dict(os.environ, **env)
    # A variant's own PYTHONPATH (another checkout's titan_lite, say) comes before this checkout.
    paths = [env.get("PYTHONPATH"), str(REPO), os.environ.get("PYTHONPATH")]
    full["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return argv, full
