"""Perplexity of magnitude, Wanda and SparseGPT at 50% (or --sparsities) unstructured and 2:4 against the dense
model, measured the way a user would: scripts/prune.py for each method and pattern, scripts/eval_ppl.py for each
folder, and (with --transformers) transformers' LlamaForCausalLM on the same windows as an independent check.

    .venv/bin/python benchmarks/prune_quality.py --hf_assets_path outputs/debug_tied/checkpoint/step-600-hf \\
        --eval_data titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt --seq_len 256 \\
        --nsamples 64 --sparsities 0.5,0.7 --out outputs/prune_quality --transformers
"""

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("magnitude", "wanda", "sparsegpt")


def run(script: str, *args: str) -> str:
    """The script's stdout; its command is echoed first."""
    command = [sys.executable, str(REPO / "scripts" / script), *args]
    print("$ " + " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def perplexity(folder: Path, opts: argparse.Namespace) -> float:
    out = run("eval_ppl.py", "--hf_assets_path", str(folder), "--data", opts.eval_data, "--seq_len",
              str(opts.seq_len), *(["--max_windows", str(opts.max_windows)] if opts.max_windows else []))
    return float(out.strip().splitlines()[-1].removeprefix("perplexity: "))


def transformers_perplexity(folder: Path, opts: argparse.Namespace) -> float:
    """exp(mean NLL) of LlamaForCausalLM over the same windows (the tokens come from titan_lite's tokenizer)."""
    import torch
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from titan_lite.data.tokenizer import build_tokenizer
    from titan_lite.eval.perplexity import read_text, text_windows

    ids = build_tokenizer(str(folder)).encode(read_text(opts.eval_data), bos=True, eos=False)
    windows = text_windows(ids, opts.seq_len, opts.max_windows)
    model = LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    # run as a file (not -m): benchmarks/cli.py's helper is not importable here; the whole first paragraph
    parser = argparse.ArgumentParser(prog=".venv/bin/python benchmarks/prune_quality.py",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--hf_assets_path", required=True, help="the dense (trained) HF folder")
    parser.add_argument("--eval_data", required=True, help="text to evaluate on")
    parser.add_argument("--calib_path", help="calibration text (default: the bundled training plays)")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--max_windows", type=int)
    parser.add_argument("--out", required=True, help="folder for the pruned models")
    parser.add_argument("--transformers", action="store_true", help="also compute transformers' perplexity")
    parser.add_argument("--sparsities", default="0.5",
                        help="comma list of unstructured sparsities (2:4 runs as well) (default: %(default)s)")
    opts = parser.parse_args()
    settings = [("unstructured", float(s)) for s in opts.sparsities.split(",")] + [("2:4", 0.5)]
    rows = [("dense", "-", Path(opts.hf_assets_path), 0.0)]
    for pattern, sparsity in settings:
        label = f"{pattern} {sparsity:.0%}" if pattern == "unstructured" else pattern
        for method in METHODS:
            folder = Path(opts.out) / f"{method}-{label.replace(':', 'of').replace(' ', '-').replace('%', '')}"
            begin = time.monotonic()
            run("prune.py", "--hf_assets_path", opts.hf_assets_path, "--output_dir", str(folder), "--method", method,
                "--pattern", pattern, "--sparsity", str(sparsity), "--nsamples", str(opts.nsamples), "--seq_len",
                str(opts.seq_len), *(["--calib_path", opts.calib_path] if opts.calib_path else []))
            rows.append((method, label, folder, time.monotonic() - begin))
    print(f"\n| method | pattern | perplexity (eval_ppl.py) |{' transformers |' if opts.transformers else ''} "
          f"prune time |")
    print(f"| --- | --- | --- |{' --- |' if opts.transformers else ''} --- |")
    by_label: dict[str, list[tuple[float, str]]] = {}
    for method, label, folder, seconds in rows:
        ours = perplexity(folder, opts)
        by_label.setdefault(label, []).append((ours, method))
        theirs = f" {transformers_perplexity(folder, opts):.4f} |" if opts.transformers else ""
        print(f"| {method} | {label} | {ours:.4f} |{theirs} {seconds:.1f}s |", flush=True)
    rankings = [f"{label}: " + " < ".join(m for _, m in sorted(v)) for label, v in by_label.items() if label != "-"]
    print(f"result: dense perplexity {by_label['-'][0][0]:.4f}; lowest perplexity first, " + "; ".join(rankings))


if __name__ == "__main__":
    main()
