"""Sparse recovery measured the way a user runs it: perplexity of (a) a Wanda-pruned model, (b) masked LoRA
(lora.keep_sparsity) merged, and its unmerged perplexity, and (c) plain LoRA merged then re-masked to the pruned zeros,
with the same steps and data (train_configs/sparse_recovery_cpu.toml); scripts/check_sparsity.py confirms (b) and (c)
keep exactly the pruned folder's zeros.

    .venv/bin/python benchmarks/sparse_recovery.py --hf_assets_path outputs/debug_tied/checkpoint/step-220-hf \\
        --eval_data titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt --out outputs/sparse_bench
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "train_configs" / "sparse_recovery_cpu.toml"


def run(command: list[str], env: dict | None = None) -> str:
    """The command's stdout (it is echoed first); a failure stops the benchmark with its output's tail."""
    print("$ " + " ".join(command), flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}  # this checkout's titan_lite, not an installed one
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def script(name: str, *args: str) -> str:
    return run([sys.executable, str(REPO / "scripts" / name), *args])


def perplexity(opts: argparse.Namespace, *model: str) -> float:
    out = script("eval_ppl.py", *model, "--data", opts.eval_data, "--seq_len", str(opts.seq_len),
                 *(["--max_windows", str(opts.max_windows)] if opts.max_windows else []))
    return float(out.strip().splitlines()[-1].removeprefix("perplexity: "))


def train(opts: argparse.Namespace, pruned: Path, dump: Path, keep_sparsity: str) -> Path:
    """The recipe from the pruned folder; returns its checkpoint folder (step-N-hf, step-N-adapter)."""
    run([str(REPO / "run_train.sh"), "--job.dump_folder", str(dump), "--checkpoint.initial_load_path", str(pruned),
         "--lora.keep_sparsity", keep_sparsity, "--training.steps", str(opts.steps), "--checkpoint.interval",
         str(opts.steps)], env={"CONFIG_FILE": str(RECIPE), "NGPU": "1"})
    return dump / "checkpoint"


def same_zeros(folder: Path, pruned: Path) -> str:
    out = script("check_sparsity.py", "--hf", str(folder), "--same_zeros_as", str(pruned))
    return next(line for line in out.splitlines() if line.startswith("result: "))


def main() -> None:
    # run as a file (not -m): benchmarks/cli.py's helper is not importable here; the whole first paragraph
    parser = argparse.ArgumentParser(prog=".venv/bin/python benchmarks/sparse_recovery.py",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--hf_assets_path", required=True, help="the dense (trained) HF folder")
    parser.add_argument("--eval_data", required=True, help="held-out text to evaluate on")
    parser.add_argument("--out", required=True, help="folder for the pruned, trained and merged models")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--pruned", help="an existing Wanda-pruned folder of the model (default: prune it first)")
    parser.add_argument("--max_windows", type=int, help="evaluate only the first K windows")
    parser.add_argument("--steps", type=int, default=150, help="LoRA steps of each recovery run (the recipe's 150)")
    opts = parser.parse_args()
    out = Path(opts.out)
    pruned = Path(opts.pruned) if opts.pruned else out / "wanda50"
    if not opts.pruned:
        script("prune.py", "--hf_assets_path", opts.hf_assets_path, "--output_dir", str(pruned), "--method", "wanda",
               "--sparsity", "0.5", "--nsamples", str(opts.nsamples), "--seq_len", str(opts.seq_len))
    masked = train(opts, pruned, out / "masked", "on")
    plain = train(opts, pruned, out / "plain", "off")
    remasked = out / "plain-remasked"
    script("prune.py", "--hf_assets_path", str(plain / f"step-{opts.steps}-hf"), "--remask_from", str(pruned),
           "--output_dir", str(remasked))
    merged = masked / f"step-{opts.steps}-hf"
    rows = [("dense", perplexity(opts, "--hf_assets_path", opts.hf_assets_path)),
            ("(a) Wanda 50% unstructured", perplexity(opts, "--hf_assets_path", str(pruned))),
            ("(b) masked LoRA, merged", perplexity(opts, "--hf_assets_path", str(merged))),
            ("(b) masked LoRA, unmerged", perplexity(opts, "--hf_assets_path", str(pruned), "--adapter",
                                                     str(masked / f"step-{opts.steps}-adapter"))),
            ("(c) plain LoRA, merged, re-masked", perplexity(opts, "--hf_assets_path", str(remasked))),
            ("plain LoRA, merged (dense)", perplexity(opts, "--hf_assets_path", str(plain / f"step-{opts.steps}-hf")))]
    checks = {"(b)": same_zeros(merged, pruned), "(c)": same_zeros(remasked, pruned)}
    print("\n| model | perplexity |\n| --- | --- |")
    for label, value in rows:
        print(f"| {label} | {value:.4f} |")
    for label, line in checks.items():
        print(f"check_sparsity {label}: {line}")
    ppl = dict(rows)
    b, c = ppl["(b) masked LoRA, merged"], ppl["(c) plain LoRA, merged, re-masked"]
    print(f"result: (a) {ppl['(a) Wanda 50% unstructured']:.4f}, (b) {b:.4f} (unmerged "
          f"{ppl['(b) masked LoRA, unmerged']:.4f}), (c) {c:.4f}: (b) {'<' if b < c else '>='} (c) after "
          f"{opts.steps} steps each")


if __name__ == "__main__":
    main()
