"""A rollout's decoding with the LoRA adapters folded into their base weights (the transform's folded_for_decoding,
what grpo.fold_adapters does) against the adapters applied apart in every decode step, on the trainer's own policy:
the same prompts and uniform numbers, rounds alternating so the machine's load hits both alike.

With `--base nf4` (QLoRA) the transform keeps the adapters apart (the NF4 weight stays quantized); the folded
alternative measured here is the benchmark's own: each NF4 weight swapped for a dense float32 W + s B A for the
rollout (as merge_lora would write it), to say which is faster and at what memory.

Run by benchmarks/run.py (the `rollout_fold` case); by hand:

    .venv/bin/python -m benchmarks.rollout_fold --base float32 --rounds 3

Prints a line per round and the result line benchmarks.worker's readers take."""

import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.cli import parser
from benchmarks.grpo import REPO, write_prompts
from benchmarks.worker import PROGRESS_PREFIX, RESULT_PREFIX, machine_busy_seconds, peak_rss_bytes
from titan_lite.config import parse_args
from titan_lite.generate import GenerationConfig, sample
from titan_lite.train import Trainer
from titan_lite.transforms.lora.module import LoRALinear, merged_weight
from titan_lite.transforms.nf4 import dequantize, is_nf4


def trainer_for(folder: Path, opts) -> Trainer:
    data = write_prompts(folder / "prompts.jsonl", most_words=8)
    nf4 = ["--lora.base_dtype", "nf4"] if opts.base == "nf4" else []
    cfg = parse_args(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--model.flavor",
                      opts.flavor, "--model.hf_assets_path", str(REPO / "assets/tokenizer"),
                      "--training.dataset", "prompts", "--training.dataset_path", str(data),
                      "--training.local_batch_size", str(opts.batch), "--training.global_batch_size", str(opts.batch),
                      "--grpo.num_generations", "2", "--grpo.max_completion_length", str(opts.max_new),
                      "--training.seq_len", str(opts.prompt_len + opts.max_new),
                      "--model.converters", "lora", "--lora.rank", "16", *nf4, "--validation.enable=false",
                      "--metrics.enable_tensorboard=false", "--job.dump_folder", str(folder / "out")])
    return Trainer(cfg)


@torch.no_grad()
def trained_adapters(model: nn.Module, scale: float = 0.02, seed: int = 0) -> None:
    """Adapters as training leaves them (fresh ones are the base: B = 0, DoRA's magnitude its norms), drawn with
    `scale`: the folded and the apart products then differ."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("lora_b"):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        elif name.endswith("magnitude"):
            p.mul_(1 + scale * torch.rand(p.shape, generator=g))


@contextlib.contextmanager
def dense_folded(model: nn.Module):
    """QLoRA's folded alternative: each NF4 weight replaced by a dense float32 W + s B A for the rollout."""
    saved = []
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear) and is_nf4(m.weight):
                saved.append((m, m.weight))
                m.weight = nn.Parameter(merged_weight(dequantize(m.weight), m.lora_a, m.lora_b, m.scale),
                                        requires_grad=False)
                m.folded = True
    try:
        yield
    finally:
        for m, weight in saved:
            m.weight, m.folded = weight, False


def folding(trainer: Trainer, base: str):
    model = trainer.model_parts[0]
    if base == "nf4":
        return dense_folded(model)
    context = trainer.transforms.folded_for_decoding(trainer.model_parts)
    assert context is not None, "the transform folded nothing"
    return context


def run(opts, folder: Path) -> dict:
    trainer = trainer_for(folder, opts)
    model, device = trainer.model_parts[0], trainer.device
    trained_adapters(model)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(opts.prompt_len // 2, opts.prompt_len + 1, (opts.batch,), generator=g).tolist()
    prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist() for n in lengths]
    generation = GenerationConfig(max_new_tokens=opts.max_new, temperature=1.0, seed=2)
    out = {"apart_s": [], "folded_s": [], "tokens": opts.batch * opts.max_new}
    decoded = {}
    busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    for round_ in range(opts.warmup + opts.rounds):
        for mode in ("apart", "folded"):
            context = folding(trainer, opts.base) if mode == "folded" else contextlib.nullcontext()
            start = time.perf_counter()
            with trainer.runner.context(), context:
                decoded[mode] = sample(model, prompts, generation, device)
            seconds = time.perf_counter() - start
            if round_ >= opts.warmup:
                out[f"{mode}_s"].append(seconds)
            print(f"{PROGRESS_PREFIX}{opts.base} round {round_ + 1}{' (warmup)' if round_ < opts.warmup else ''} "
                  f"{mode}: {out['tokens'] / seconds:.1f} tokens/s", flush=True)
    same = all(a.tokens == b.tokens for a, b in zip(decoded["apart"], decoded["folded"], strict=True))
    diff = max(abs(x - y) for a, b in zip(decoded["apart"], decoded["folded"], strict=True)
               for x, y in zip(a.logps, b.logps, strict=False))
    wall, cpu, busy1 = time.perf_counter() - wall0, time.process_time() - cpu0, machine_busy_seconds()
    return out | {"base": opts.base, "same_tokens": same, "max_logp_diff": diff, "wall_s": wall, "own_cpu_s": cpu,
                  "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.rollout_fold")
    p.add_argument("--base", choices=["float32", "nf4"], default="float32", help="the frozen base: LoRA or QLoRA")
    p.add_argument("--flavor", default="debugmodel", help="the model (tiny: a seconds-long smoke run)")
    p.add_argument("--batch", type=int, default=32, help="completions decoded together (even)")
    p.add_argument("--prompt_len", type=int, default=64, help="the longest prompt (the shortest: half of it)")
    p.add_argument("--max_new", type=int, default=32, help="tokens decoded per completion (no stop tokens)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, each decoding apart then folded")
    p.add_argument("--warmup", type=int, default=1)
    opts = p.parse_args(argv)
    logging.getLogger("titan_lite").setLevel(logging.WARNING)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="titan_lite_fold_bench_") as folder:
        result = run(opts, Path(folder))
    result.update(rank=0, world=1, peak_rss_bytes=peak_rss_bytes())
    apart, folded = sum(result["apart_s"]), sum(result["folded_s"])
    n = len(result["apart_s"]) * result["tokens"]
    print(f"{opts.base}: decode {n / apart:.1f} tokens/s with the adapters apart, {n / folded:.1f} folded "
          f"({apart / folded:.2f}x); same tokens: {result['same_tokens']}, largest log-probability difference "
          f"{result['max_logp_diff']:.2e}", flush=True)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
