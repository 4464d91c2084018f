"""Recovery of a pruned model measured the way a user runs it: the dense model width-pruned (scripts/prune.py --method
taylor_structured, half the heads and MLP channels) or depth-pruned (--method depth), then the same steps on the same
data twice from the pruned folder (train_configs/distill_recovery_cpu.toml): plain training (cross entropy) and
distillation from the dense model; held-out perplexity (scripts/eval_ppl.py) of the dense, pruned and both recovered
models, and each run's throughput.

    python benchmarks/distill_recovery.py --hf_assets_path outputs/debug_tied/checkpoint/step-600-hf \\
        --eval_data titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt --out outputs/distill_bench
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "train_configs" / "distill_recovery_cpu.toml"
TPS = re.compile(r"step:\s*(\d+)/\d+\s.*?tps:\s*([\d,]+)")


def run(command: list[str], env: dict | None = None) -> str:
    """The command's stdout and stderr (it is echoed first); a failure stops the benchmark with its output's tail."""
    print("$ " + " ".join(command), flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}  # this checkout's titan_lite, not an installed one
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout + done.stderr


def script(name: str, *args: str) -> str:
    return run([sys.executable, str(REPO / "scripts" / name), *args])


def perplexity(opts: argparse.Namespace, folder: Path) -> float:
    out = script("eval_ppl.py", "--hf_assets_path", str(folder), "--data", opts.eval_data, "--seq_len",
                 str(opts.seq_len), *(["--max_windows", str(opts.max_windows)] if opts.max_windows else []))
    return float(out.strip().splitlines()[-1].removeprefix("perplexity: "))


def train(opts: argparse.Namespace, pruned: Path, dump: Path, distill: bool) -> tuple[Path, float]:
    """The recipe from the pruned folder, with or without the teacher: (its final HF export, its median tokens/s
    after the first logged step)."""
    output = run([str(REPO / "run_train.sh"), "--job.dump_folder", str(dump), "--model.hf_assets_path", str(pruned),
                  "--distill.teacher_path", opts.hf_assets_path, f"--distill.enable={str(distill).lower()}",
                  "--training.steps", str(opts.steps), "--checkpoint.interval", str(opts.steps)],
                 env={"CONFIG_FILE": str(RECIPE), "NGPU": "1"})
    rates = [int(tps.replace(",", "")) for step, tps in TPS.findall(output) if int(step) > 1]
    return dump / "checkpoint" / f"step-{opts.steps}-hf", statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(prog=".venv/bin/python benchmarks/distill_recovery.py",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--hf_assets_path", required=True, help="the dense (trained) HF folder: the teacher")
    parser.add_argument("--eval_data", required=True, help="held-out text to evaluate on")
    parser.add_argument("--out", required=True, help="folder for the pruned and recovered models")
    parser.add_argument("--prune", choices=("width", "depth"), default="width",
                        help="width: taylor_structured at --ratio of the heads and MLP channels; depth: "
                             "--remove_layers blocks")
    parser.add_argument("--ratio", type=float, default=0.5, help="width: fraction of heads and channels removed")
    parser.add_argument("--remove_layers", type=int, default=2, help="depth: blocks removed")
    parser.add_argument("--steps", type=int, default=100, help="steps of each recovery run (the recipe's 100)")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--nsamples", type=int, default=32, help="calibration windows of the depth pruning")
    parser.add_argument("--max_windows", type=int, help="evaluate only the first K windows")
    opts = parser.parse_args()
    out = Path(opts.out)
    if opts.prune == "width":
        pruned, what = out / f"taylor-{opts.ratio:g}", f"width-pruned, {opts.ratio:.0%} of heads and channels"
        how = ["--method", "taylor_structured", "--head_ratio", str(opts.ratio), "--ffn_ratio", str(opts.ratio)]
    else:
        pruned, what = out / f"depth-{opts.remove_layers}", f"depth-pruned, {opts.remove_layers} blocks removed"
        how = ["--method", "depth", "--remove_layers", str(opts.remove_layers)]
    script("prune.py", "--hf_assets_path", opts.hf_assets_path, "--output_dir", str(pruned), *how, "--nsamples",
           str(opts.nsamples), "--seq_len", str(opts.seq_len), "--batch_size", "4")
    plain, plain_tps = train(opts, pruned, out / "plain", distill=False)
    distilled, distill_tps = train(opts, pruned, out / "distilled", distill=True)
    rows = [("dense (the teacher)", perplexity(opts, Path(opts.hf_assets_path)), None),
            (what, perplexity(opts, pruned), None),
            (f"plain training, {opts.steps} steps", perplexity(opts, plain), plain_tps),
            (f"distillation, {opts.steps} steps", perplexity(opts, distilled), distill_tps)]
    print("\n| model | perplexity | training tokens/s |\n| --- | --- | --- |")
    for label, value, tps in rows:
        print(f"| {label} | {value:.4f} | {f'{tps:,.0f}' if tps else '-'} |")
    ppl = {label: value for label, value, _ in rows}
    p, d = rows[2][1], rows[3][1]
    print(f"result: after {opts.steps} steps each, distillation {d:.4f} {'<' if d < p else '>='} plain {p:.4f} "
          f"(pruned {ppl[rows[1][0]]:.4f}, dense {ppl[rows[0][0]]:.4f}); the distilled run's step takes "
          f"{plain_tps / distill_tps:.2f}x the plain run's")


if __name__ == "__main__":
    main()
