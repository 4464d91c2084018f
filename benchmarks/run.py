"""The benchmark entry point: runs the cases' variants alternately (A/B/A/B...) in fresh processes, prints a table
of medians and ratios with the machine's load, and writes every run to JSON.

    .venv/bin/python -m benchmarks.run                       # the default cases (see --list)
    .venv/bin/python -m benchmarks.run --cases train_debug --repeats 3
"""

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.cases import CASES, DEFAULT_CASES
from benchmarks.cli import parser
from benchmarks.framework import REPO, Case, RunOutput, Settings, Variant, environment_of
from benchmarks.variants import MatmulPeakVariant
from benchmarks.worker import PROGRESS_PREFIX

_LABELS = {"tokens_per_s": "tokens/s", "mfu_pct": "MFU %", "step_s": "step s", "peak_rss_gib": "peak RSS GiB",
           "peak_tensor_gib": "tensors GiB",
           "wall_s": "wall s", "cpu_s": "CPU s", "gflops": "GFLOP/s", "cpu_s_per_step": "CPU s/step",
           "sys_s_per_step": "sys s/step",
           "prune_s": "prune s", "floor_s": "floor s", "transformers_step_s": "HF step s",
           "kernel_floor_s": "kernels s", "distill_step_s": "distilled s", "teacher_forward_s": "teacher fwd s",
           "teacher_cost_s": "teacher cost s", "trained_tokens_per_s": "trained tok/s",
           "trained_pct": "trained %", "real_pct": "not padding %", "pairs_per_s": "pairs/s",
           "duplicated_s_per_pair": "copies s/pair", "shared_s_per_pair": "shared s/pair",
           "duplicated_tokens_per_pair": "copies tok/pair", "shared_tokens_per_pair": "shared tok/pair",
           "logps_max_difference": "logp max diff", "dpo_step_s": "DPO step s", "given_step_s": "given step s",
           "reference_cost_s": "ref cost s", "reference_forward_s": "ref fwd s", "parameter_gib_held": "params GiB",
           "planned_peak_gib": "planned GiB", "plan_error_pct": "plan error %", "base_vs_bf16": "base/bf16",
           "generation_s": "generation s", "scoring_s": "scoring s", "reference_s": "reference s",
           "policy_s": "policy s", "rollout_tokens_per_s": "rollout tok/s", "train_tokens_per_s": "train tok/s",
           "padding_pct": "padding %",
           "apart_tokens_per_s": "apart tok/s", "folded_tokens_per_s": "folded tok/s", "same_tokens": "same tokens",
           "static_ms_per_token": "static ms/tok",
           "chunked_ms_per_token": "chunks ms/tok", "engine_ms_per_token": "engine ms/tok",
           "engine_working_pct": "working %", "shared_prefill_s": "prefill s", "engine_tokens_per_s": "engine tok/s",
           "transformers_tokens_per_s": "HF tok/s", "titan_lite_tokens_per_s": "titan tok/s",
           "chunked_rule_s": "chunked s", "recurrent_rule_s": "recurrent s", "logits_max_difference": "logits diff"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.run")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma list of cases (default: %(default)s)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds per case; medians over them")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiled runs take 2 more)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads in all, shared by a variant's processes (default: the cores)")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="a run during which other processes kept more cores than this busy is disturbed")
    p.add_argument("--max-spread", type=float, default=1.5,
                   help="a run whose slowest step is this many times its fastest is disturbed")
    p.add_argument("--retries", type=int, default=1, help="repeats of a disturbed run (the least disturbed is kept)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--json", default="outputs/benchmarks/results.json", help="where every run and median goes")
    return p.parse_args(argv)


def machine_load() -> str:
    """`uptime`'s line, or the load averages where there is no uptime."""
    if shutil.which("uptime"):
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def execute(variant: Variant, settings: Settings, timeout: float) -> RunOutput:
    """Run the variant's command in a fresh process group; its own CPU time and peak RSS come from wait4. Its
    progress lines are printed as they come; the group is killed when this process stops first (Ctrl-C, SIGTERM),
    and the child dies with it even when it is killed outright (PR_SET_PDEATHSIG)."""
    argv, env = environment_of(variant, settings)
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)
        try:
            status, usage = _wait(proc, start + timeout, log)
        finally:
            if proc.returncode is None:  # stopped before the child finished: none of its processes outlive us
                _kill_group(proc.pid)
        wall = time.perf_counter() - start
        log.seek(0)
        stdout = log.read().decode(errors="replace")
    return RunOutput(stdout, proc.returncode, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the benchmark process dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _wait(proc: subprocess.Popen, deadline: float, log=None):
    """(status, rusage) of the finished process, printing its progress lines meanwhile; its process group is killed
    at the deadline."""
    seen = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        seen = _print_progress(log, seen)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return status, usage
        if time.perf_counter() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.2)


def _print_progress(log, seen: int) -> int:
    """The child's new whole progress lines in `log` from byte `seen` on, printed; the offset after them. pread:
    the child writes through the same file offset, which a seek here would move."""
    if log is None:
        return seen
    data = os.pread(log.fileno(), 1 << 20, seen)
    whole = data[:data.rfind(b"\n") + 1]
    for line in whole.decode(errors="replace").splitlines():
        if line.startswith(PROGRESS_PREFIX):
            print(f"    {line[len(PROGRESS_PREFIX):]}", flush=True)
    return seen + len(whole)


# ------------------------------------------------------------------------------------- measuring


def is_disturbed(m: dict, opts: argparse.Namespace) -> bool:
    return m["foreign_cores"] > opts.max_foreign or m.get("step_spread", 1.0) > opts.max_spread


def measure(variant: Variant, settings: Settings, opts: argparse.Namespace, tag: str) -> dict:
    """One run of the variant; a run disturbed by foreign load is repeated (--retries), the least disturbed kept."""
    kept = None
    for attempt in range(opts.retries + 1):
        out = execute(variant, settings, opts.timeout)
        m = variant.metrics(out)
        m["disturbed"] = is_disturbed(m, opts)
        m["load_1min"] = os.getloadavg()[0]
        print(f"  {tag} {variant.label}: {_brief(m)}" + (" (disturbed)" if m["disturbed"] else "")
              + (f" [retry {attempt}]" if attempt else ""), flush=True)
        if kept is None or m["foreign_cores"] < kept["foreign_cores"]:
            kept = m
        if not m["disturbed"]:
            break
    return kept


def _brief(m: dict) -> str:
    keys = ("tokens_per_s", "gflops", "wall_s", "prune_s", "floor_s", "step_s", "transformers_step_s",
            "kernel_floor_s", "cpu_s_per_step", "peak_rss_gib", "peak_tensor_gib")
    shown = [f"{_fmt(m[k])} {_LABELS[k]}" for k in keys if k in m]
    return ", ".join(shown) + f", foreign load {m['foreign_cores']:.2f} cores"


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def run_case(case: Case, settings: Settings, opts: argparse.Namespace, peaks: list[float]) -> dict:
    """Rounds of every variant in turn (A/B/A/B...); each round first measures the matmul peak for MFU."""
    runs: dict[str, list[dict]] = {v.label: [] for v in case.variants}
    failed: dict[str, str] = {}
    trains = "tokens_per_s" in case.columns  # (the peak is for MFU: a case of rollout or trained tokens/s has none)
    rounds = max(opts.repeats, case.min_rounds)
    rounds = rounds if case.max_rounds is None else min(rounds, case.max_rounds)
    for r in range(rounds):
        if trains:
            peaks.append(measure(MatmulPeakVariant("fp32 matmul peak"), settings, opts, f"[{case.name} {r + 1}]")
                         ["gflops"])
        for variant in case.variants:
            if variant.label in failed:
                continue
            try:
                runs[variant.label].append(measure(variant, settings, opts, f"[{case.name} {r + 1}/{rounds}]"))
            except RuntimeError as exc:
                failed[variant.label] = str(exc)
                print(f"  error: {case.name} {variant.label} failed: {str(exc).splitlines()[0]}\n"
                      + "\n".join(str(exc).splitlines()[-15:]), flush=True)
    return {"name": case.name, "description": case.description, "columns": list(case.columns),
            "variants": [{"label": label, "runs": rs, "median": _medians(rs), "failed": failed.get(label)}
                         for label, rs in runs.items()]}


def _medians(runs: list[dict]) -> dict:
    if not runs:
        return {}
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"disturbed_runs": sum(r["disturbed"]
                                                                                            for r in runs)}


def add_mfu(result: dict, peak_gflops: float) -> None:
    for v in result["variants"]:
        for m in v["runs"] + ([v["median"]] if v["median"] else []):
            if "tokens_per_s" in m:
                m["mfu_pct"] = 100 * m["tokens_per_s"] * m["flops_per_token"] / (peak_gflops * 1e9)


def ratios_of(case: Case, result: dict) -> list[dict]:
    medians = {v["label"]: v["median"] for v in result["variants"]}
    out = []
    for ratio in case.ratios:
        num, den = medians.get(ratio.numerator, {}), medians.get(ratio.denominator, {})
        den_metric = ratio.denominator_metric or ratio.metric
        if ratio.metric not in num or den_metric not in den:
            continue
        value = num[ratio.metric] / den[den_metric]
        met = None if ratio.target is None else (value >= ratio.target if ratio.higher_is_better
                                                 else value <= ratio.target)
        out.append({"label": ratio.label, "value": value, "target": ratio.target, "met": met,
                    "higher_is_better": ratio.higher_is_better})
    return out


# ---------------------------------------------------------------------------------------- report


def table(results: list[dict], peak_gflops: float | None) -> str:
    """The results table; `peak_gflops` None when no case trains (the peak is measured for MFU only)."""
    lines = [f"fp32 matmul peak (median): {peak_gflops:.1f} GFLOP/s" if peak_gflops is not None else
             "fp32 matmul peak: not measured (no case here trains; it is what MFU is measured against)"]
    for res in results:
        cols = res["columns"]
        lines.append("")
        lines.append(f"{res['name']} ({res['description']})".ljust(38)
                     + "".join(_LABELS[c].rjust(14) for c in cols) + "runs (disturbed)".rjust(18))
        for v in res["variants"]:
            m = v["median"]
            if v["failed"] and not m:
                lines.append(f"  {v['label']}".ljust(38) + "  failed")
                continue
            lines.append(f"  {v['label']}".ljust(38) + "".join(_fmt(m[c]).rjust(14) if c in m else "-".rjust(14)
                                                            for c in cols)
                         + f"{len(v['runs'])} ({m['disturbed_runs']})".rjust(18))
        for r in res["ratios"]:
            sign, met = (">=" if r["higher_is_better"] else "<="), ("met" if r["met"] else "NOT met")
            verdict = "" if r["target"] is None else f" (target {sign} {r['target']:.2f}x: {met})"
            lines.append(f"  ratio {r['label']}: {r['value']:.2f}x{verdict}")
    return "\n".join(lines)


def summary_line(results: list[dict], load: str, path: Path) -> str:
    ratios = [(res["name"], r) for res in results for r in res["ratios"]]
    targets = [r for _, r in ratios if r["met"] is not None]
    parts = [f"{name} {r['label']} {r['value']:.2f}x" for name, r in ratios]
    failed = [f"{res['name']}/{v['label']}" for res in results for v in res["variants"] if v["failed"]]
    text = f"result: {sum(r['met'] for r in targets)}/{len(targets)} targets met"
    text += (": " + "; ".join(parts)) if parts else ""
    text += f"; failed: {', '.join(failed)}" if failed else ""
    return text + f"; {load.split('load average:')[-1].strip()} load; JSON in {path}"


def transformers_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def select_cases(names: list[str]) -> list[Case]:
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"error: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    cases = [CASES[n]() for n in names]
    if not transformers_available():
        print("transformers is not installed (.venv/bin/pip install transformers): its side of the comparisons is "
              "skipped")
        for case in cases:
            case.variants = [v for v in case.variants if getattr(v, "impl", None) not in ("transformers", "paired")]
    return cases


def _stop(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through execute(), which ends the running child's process group


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    if opts.list:
        for name, build in CASES.items():
            case = build()
            print(f"{name}: {case.description}; variants: {', '.join(v.label for v in case.variants)}"
                  + (" (default)" if name in DEFAULT_CASES else ""))
        return 0
    cases = select_cases([n for n in opts.cases.split(",") if n])
    settings = Settings(steps=opts.steps, warmup=opts.warmup, threads=opts.threads)
    load_before = machine_load()
    print(f"benchmark: {len(cases)} cases x {opts.repeats} alternating rounds (or a case's own minimum or maximum), "
          f"{opts.threads} threads; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores")
    print(f"load before: {load_before}", flush=True)
    start, peaks, results = time.perf_counter(), [], []
    for case in cases:
        print(f"{case.name}: {case.description}", flush=True)
        result = run_case(case, settings, opts, peaks)
        result["ratios"] = []
        results.append((case, result))
    peak = statistics.median(peaks) if peaks else None
    for case, result in results:
        if peak is not None:
            add_mfu(result, peak)
        result["ratios"] = ratios_of(case, result)
    load_after = machine_load()
    results = [r for _, r in results]
    print()
    print(table(results, peak))
    print(f"\nload before: {load_before}\nload after:  {load_after}\n"
          f"wall time {(time.perf_counter() - start) / 60:.1f} min; command: .venv/bin/python -m benchmarks.run "
          + " ".join(sys.argv[1:] if argv is None else argv))
    path = REPO / opts.json if not os.path.isabs(opts.json) else Path(opts.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": asdict(settings), "options": vars(opts), "load_before": load_before,
                                "load_after": load_after, "matmul_peak_gflops": peak, "matmul_peaks": peaks,
                                "torch": torch.__version__, "cases": results}, indent=1))
    print(summary_line(results, load_after, path))
    return 1 if any(v["failed"] for r in results for v in r["variants"]) else 0


if __name__ == "__main__":
    sys.exit(main())
