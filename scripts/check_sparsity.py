"""Sparsity of every block linear (q, k, v, o, gate, up, down) of a Hugging Face folder, whether N:M patterns hold
(at least N zeros in every group of M consecutive inputs of a row: 2:4 and 4:8, or --pattern), and with
--same_zeros_as whether each linear has exactly another folder's zeros. The last line says whether the check
passed; exit status 1 when --pattern or --same_zeros_as does not hold for every linear.

    .venv/bin/python scripts/check_sparsity.py --hf outputs/sparse_recovery/checkpoint/step-150-hf \\
        --pattern unstructured --same_zeros_as outputs/debug_tied_wanda50
"""

import argparse
import sys
from pathlib import Path

import torch

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.checkpoint.hf import SafetensorsReader, weight_files
from titan_lite.errors import ConfigError
from titan_lite.job.cli import ScriptParser
from titan_lite.job.script import run_script
from titan_lite.transforms.pruning.masks import Pattern
from titan_lite.transforms.pruning.remask import HF_LINEAR

DEFAULT_PATTERNS = (Pattern(2, 4), Pattern(4, 8))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--hf", required=True, help="the Hugging Face folder to check")
    parser.add_argument("--pattern", help="require this pattern: unstructured (any zeros) or N:M, e.g. 2:4")
    parser.add_argument("--same_zeros_as", help="an HF folder of the same model whose zeros each linear must equal")
    return parser.parse_args(argv)


def holds(zeros: torch.Tensor, pattern: Pattern) -> bool:
    """At least n zeros in every group of m consecutive inputs of every row."""
    rows, cols = zeros.shape
    return cols % pattern.m == 0 and bool((zeros.view(rows, cols // pattern.m, pattern.m).sum(-1) >= pattern.n).all())


def parse_pattern(text: str | None) -> Pattern | None:
    if text is None:
        return None
    try:
        pattern = Pattern.parse(text)
    except ValueError:
        raise ConfigError(f"--pattern '{text}' is not 'unstructured' or N:M (e.g. 2:4)") from None
    if pattern.structured and not 0 < pattern.n < pattern.m:
        raise ConfigError(f"--pattern '{text}': N:M needs 0 < N < M")
    return pattern


def linear_files(folder: str) -> dict[str, Path]:
    if not Path(folder).is_dir():
        raise ConfigError(f"'{folder}' is not a folder")
    linears = {name: path for name, path in weight_files(folder).items() if HF_LINEAR.fullmatch(name)}
    if not linears:
        raise ConfigError(f"{folder}: no block linear weights (model.layers.N.self_attn.q_proj.weight, ...)")
    return linears


def check(opts: argparse.Namespace) -> tuple[str, bool]:
    """Print a line per linear and the summary line; return the verdict line and whether every requested check
    held."""
    required = parse_pattern(opts.pattern)
    patterns = list(DEFAULT_PATTERNS)
    if required is not None and required.structured and required not in patterns:
        patterns.append(required)
    linears = linear_files(opts.hf)
    reference = linear_files(opts.same_zeros_as) if opts.same_zeros_as else None
    total = zero_count = same = 0
    held = dict.fromkeys(patterns, 0)
    with SafetensorsReader() as reader:
        for name in sorted(linears, key=_layer_order):
            zeros = reader.tensor(linears[name], name) == 0
            total, zero_count = total + zeros.numel(), zero_count + int(zeros.sum())
            line = f"{name:<48} {list(zeros.shape)!s:<13} {zeros.float().mean().item():7.2%} zeros"
            for pattern in patterns:
                ok = holds(zeros, pattern)
                held[pattern] += ok
                line += f"  {pattern} {'yes' if ok else 'no'}"
            if reference is not None:
                if name not in reference:
                    raise ConfigError(f"{opts.same_zeros_as}: no tensor '{name}' to compare the zeros with")
                other = reader.tensor(reference[name], name) == 0
                if other.shape != zeros.shape:
                    raise ConfigError(f"{opts.same_zeros_as}: '{name}' has shape {list(other.shape)}, "
                                      f"not {list(zeros.shape)}")
                equal = torch.equal(zeros, other)
                same += equal
                line += f"  same zeros {'yes' if equal else 'NO'}"
            print(line, flush=True)
    n = len(linears)
    summary = f"result: {n} linears, {zero_count / total:.2%} zeros; " + ", ".join(
        f"{p} holds in {held[p]}/{n}" for p in patterns)
    checks = []  # (what held, what failed, whether it held) for each requested check
    if required is not None and required.structured:
        checks.append((f"{required} holds in every linear ({n}/{n})",
                       f"{required} holds in {held[required]}/{n} linears (--pattern {required})", held[required] == n))
    elif required is not None:
        checks.append((f"the linears hold zeros ({zero_count / total:.2%})",
                       "no linear holds a zero (--pattern unstructured)", zero_count > 0))
    if reference is not None:
        summary += f"; zeros identical to {opts.same_zeros_as} in {same}/{n}"
        checks.append((f"zeros identical to {opts.same_zeros_as} in every linear ({n}/{n})",
                       f"zeros identical to {opts.same_zeros_as} in {same}/{n} linears (--same_zeros_as)", same == n))
    print(summary, flush=True)
    if not checks:
        return "check: none requested (--pattern, --same_zeros_as), the report above only", True
    failed = [fail for _, fail, ok in checks if not ok]
    if failed:
        return f"check FAILED: {'; '.join(failed)}", False
    return f"check passed: {'; '.join(ok_text for ok_text, _, _ in checks)}", True


def _layer_order(name: str) -> tuple[int, str]:
    return int(name.split(".")[2]), name


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    outcome = {}

    def work() -> None:
        verdict, outcome["ok"] = check(opts)
        print(verdict, flush=True)
    code = run_script(work)
    return code if code or outcome["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
