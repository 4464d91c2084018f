"""Perplexity of magnitude, Wanda and SparseGPT at 50% (or --sparsities) unstructured and 2:4 against the dense
model, measured the way a user would: scripts/prune.py for each method and pattern, scripts/eval_ppl.py for each
folder, and (with --transformers) transformers' LlamaForCausalLM on the same windows as an independent check. With
--owl every unstructured sparsity also runs with OWL's layer ratios (`--layer_ratios owl`), beside uniform.

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
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list (default: %(default)s)")
    parser.add_argument("--owl", action="store_true",
                        help="also prune every unstructured sparsity with OWL's layer ratios (default M and lambda)")
    parser.add_argument("--no_2of4", action="store_true", help="skip the 2:4 rows")
    opts = parser.parse_args()
    methods = [m for m in opts.methods.split(",") if m]
    if unknown := [m for m in methods if m not in METHODS]:
        raise SystemExit(f"--methods: unknown {unknown}; expected some of {', '.join(METHODS)}")
    settings = [("unstructured", float(s), ratios) for s in opts.sparsities.split(",")
                for ratios in ("uniform", "owl")[:2 if opts.owl else 1]]
    settings += [] if opts.no_2of4 else [("2:4", 0.5, "uniform")]
    rows = [("dense", "-", Path(opts.hf_assets_path), 0.0)]
    for pattern, sparsity, ratios in settings:
        label = f"{pattern} {sparsity:.0%}" if pattern == "unstructured" else pattern
        label += " OWL" if ratios == "owl" else ""
        for method in methods:
            folder = Path(opts.out) / f"{method}-{label.replace(':', 'of').replace(' ', '-').replace('%', '')}"
            begin = time.monotonic()
            run("prune.py", "--hf_assets_path", opts.hf_assets_path, "--output_dir", str(folder), "--method", method,
                "--pattern", pattern, "--sparsity", str(sparsity), "--nsamples", str(opts.nsamples), "--seq_len",
                str(opts.seq_len), "--layer_ratios", ratios,
                *(["--calib_path", opts.calib_path] if opts.calib_path else []))
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
    if opts.owl:
        print("OWL against uniform: " + "; ".join(owl_changes(by_label)))


def owl_changes(by_label: dict[str, list[tuple[float, str]]]) -> list[str]:
    """'wanda 70%: 155.2492 -> 143.6340 (-7.48%)' for every method and sparsity pruned both ways."""
    changes = []
    for label, rows in by_label.items():
        if not label.endswith(" OWL"):
            continue
        uniform = {method: ppl for ppl, method in by_label[label.removesuffix(" OWL")]}
        for ppl, method in rows:
            before = uniform[method]
            changes.append(f"{method} {label.split()[1]}: {before:.4f} -> {ppl:.4f} ({ppl / before - 1:+.2%})")
    return changes


if __name__ == "__main__":
    main()
