"""Grouped experts against the loop over experts: one MoE layer's expert computation (forward and backward of
GroupedExperts on routed rows grouped by expert) through torch._grouped_mm and through one matmul per expert,
alternating in one process, on this machine's CPU (or CUDA when present and asked for).

    .venv/bin/python -m benchmarks.moe_experts                          # debugmodel_moe's and a 30B-A3B-like layer
    .venv/bin/python -m benchmarks.moe_experts --shapes debugmodel_moe --repeats 9

Each shape is (experts, dim, hidden, top-k, tokens): debugmodel_moe's layer on 8 x 256 tokens, and Qwen3-30B-A3B's
expert widths (128 experts of 2048 -> 768, top 8) on 512 tokens (its whole layer does not fit a quick CPU run). The
routing is uniformly random (balanced on average), the same for both paths. It prints the median seconds of each
path and grouped / loop.
"""

import statistics
import sys
import time

import torch

from benchmarks.cli import parser
from titan_lite.models.parts import experts as experts_module
from titan_lite.models.parts.experts import GroupedExperts

SHAPES = {"debugmodel_moe": (8, 256, 256, 2, 2048), "qwen3_30B_A3B_experts": (128, 2048, 768, 8, 512)}


def one_pass(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> float:
    start = time.perf_counter()
    out = experts(x, counts)
    out.backward(torch.ones_like(out))  # a contiguous gradient, as the gate weights' product gives
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(shape: tuple[int, ...], repeats: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    n_experts, dim, hidden, top_k, tokens = shape
    torch.manual_seed(0)
    experts = GroupedExperts(dim, hidden, n_experts).to(device=device, dtype=dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    choices = torch.randint(0, n_experts, (tokens * top_k,))
    counts = torch.bincount(choices, minlength=n_experts).to(device)
    x = torch.randn(tokens * top_k, dim, device=device, dtype=dtype, requires_grad=True)
    grouped_runs = experts_module.grouped_mm_runs
    paths = {"grouped": grouped_runs, "loop": lambda a, w: False}
    times: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for round_ in range(repeats + 1):  # the first round warms up
            for name, runs in paths.items():
                experts_module.grouped_mm_runs = runs
                seconds = one_pass(experts, x, counts)
                if round_:
                    times[name].append(seconds)
    finally:
        experts_module.grouped_mm_runs = grouped_runs
    return {name: statistics.median(values) for name, values in times.items()} | {
        "grouped_kernel": grouped_runs(x, experts.w1)}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.moe_experts")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of: {', '.join(SHAPES)}")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per path (after one warm-up round)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    opts = p.parse_args(argv)
    unknown = [s for s in opts.shapes.split(",") if s not in SHAPES]
    if unknown:
        print(f"error: unknown shape {', '.join(unknown)}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    print(f"grouped experts vs the loop: forward + backward of one layer's experts, {opts.device} {opts.dtype}, "
          f"{torch.get_num_threads()} threads, median of {opts.repeats}", flush=True)
    for name in opts.shapes.split(","):
        n_experts, dim, hidden, top_k, tokens = SHAPES[name]
        r = measure(SHAPES[name], opts.repeats, device, dtype)
        kernel = "torch._grouped_mm" if r["grouped_kernel"] else "the loop (torch._grouped_mm does not run here)"
        print(f"{name}: {n_experts} experts {dim} -> {hidden}, top {top_k}, {tokens} tokens: grouped "
              f"{r['grouped']:.4f} s ({kernel}), loop {r['loop']:.4f} s, grouped / loop {r['grouped'] / r['loop']:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
