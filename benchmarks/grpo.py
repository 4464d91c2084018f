"""GRPO's step on the trainer's own code (debugmodel, LoRA, a KL term to the policy's own base): its time split into
the rollout's generation (the policy sampling with the KV cache), scoring, the reference's forwards and the policy's
forward and backward; completion tokens generated per second against tokens trained per second; and, run once with
packed completions and once padded, trained tokens per second of both layouts on the same rollouts.

Run by benchmarks/run.py (the `grpo_step` case); by hand:

    .venv/bin/python -m benchmarks.grpo --layout packed --steps 2 --warmup 1

Prompts are synthetic GSM8K-format problems with Shakespeare's words in front (log-uniform 4-60 words, so prompt
lengths vary as real ones do); 4 prompts x 8 completions a step, up to 32 tokens each (an eighth of the completion
tokens of the first version, 8 x 8 x 128, whose case had not finished one run in 15 minutes; docs/rl.md has the last
run's time and load). The random debug model never ends an answer on its own, so the benchmark also stops a
completion at 16 frequent token ids (about 1% a token): completion lengths then vary as real ones do. Each step prints
a progress line (benchmarks.run shows it as it comes); the result line is benchmarks.worker's."""

import argparse
import json
import logging
import math
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.cli import parser
from benchmarks.worker import PROGRESS_PREFIX, RESULT_PREFIX, machine_busy_seconds, peak_rss_bytes
from titan_lite.config import parse_args
from titan_lite.loss import IGNORE_INDEX
from titan_lite.train import Trainer

REPO = Path(__file__).resolve().parents[1]
PROMPTS, GROUP, MAX_NEW = 4, 8, 32
EXTRA_STOPS = tuple(range(200, 216))


def write_prompts(path: Path, count: int = 400, seed: int = 0, most_words: int = 120) -> Path:
    words = (REPO / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text().split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            n = int(math.exp(rng.uniform(math.log(4), math.log(most_words))))
            start = rng.randrange(len(words) - n)
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": " ".join(words[start:start + n]) + f"\nWhat is {a} + {b}?",
                                "answer": f"#### {a + b}"}) + "\n")
    return path


def trainer_for(folder: Path, opts: argparse.Namespace) -> Trainer:
    data = write_prompts(folder / "prompts.jsonl", most_words=opts.most_words)
    cfg = parse_args(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--model.flavor",
                      opts.flavor, "--model.hf_assets_path", str(REPO / "assets/tokenizer"),
                      "--training.dataset", "prompts", "--training.dataset_path", str(data),
                      "--training.seq_len", str(opts.seq_len), "--training.local_batch_size", str(opts.local_batch),
                      "--training.global_batch_size", str(PROMPTS * GROUP), "--grpo.num_generations", str(GROUP),
                      "--grpo.max_completion_length", str(opts.max_new), "--grpo.beta", "0.04",
                      f"--grpo.packing={'true' if opts.layout == 'packed' else 'false'}",
                      "--grpo.template", "{prompt}\nAnswer:", "--model.converters", "lora", "--lora.rank", "16",
                      "--validation.enable=false", "--metrics.enable_tensorboard=false",
                      "--job.dump_folder", str(folder / "out"), "--lr_scheduler.warmup_steps", "0",
                      "--optimizer.lr", "1e-4"])
    trainer = Trainer(cfg)
    rollouts = trainer.dataloader
    generation = rollouts.s.generation
    rollouts.s = replace(rollouts.s, generation=replace(generation, stop_ids=generation.stop_ids + EXTRA_STOPS))
    return trainer


class Timed:
    """Seconds spent in a callable, summed until read."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run(opts: argparse.Namespace, folder: Path) -> dict:
    trainer = trainer_for(folder, opts)
    rollouts, objective = trainer.dataloader, trainer.objective.objective
    sampling, scoring, reference = Timed(rollouts.sample), Timed(rollouts.rewards.score), Timed(objective.reference)
    rollouts.sample, rollouts.rewards.score, objective.reference = sampling, scoring, reference
    data = iter(rollouts)
    out: dict[str, list] = {k: [] for k in ("generation_s", "scoring_s", "rollout_s", "reference_s", "policy_s",
                                            "train_s", "completion_tokens", "trained_tokens", "real_tokens",
                                            "total_tokens")}
    busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    for step in range(1, opts.warmup + opts.steps + 1):
        start = time.perf_counter()
        microbatches = trainer.next_microbatches(data)
        rollout_s = time.perf_counter() - start
        start = time.perf_counter()
        trainer.train_step(microbatches, step)
        train_s = time.perf_counter() - start
        generation_s, scoring_s, reference_s = sampling.take(), scoring.take(), reference.take()
        print(f"{PROGRESS_PREFIX}{opts.layout} step {step}/{opts.warmup + opts.steps}"
              f"{' (warmup)' if step <= opts.warmup else ''}: rollout {rollout_s:.1f} s, training {train_s:.1f} s",
              flush=True)
        if step <= opts.warmup:
            busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
            continue
        labels = [mb.labels for mb in microbatches]
        documents = [mb.documents for mb in microbatches]
        for key, value in (("generation_s", generation_s), ("scoring_s", scoring_s), ("rollout_s", rollout_s),
                           ("reference_s", reference_s), ("policy_s", train_s - reference_s), ("train_s", train_s),
                           ("completion_tokens", sum(map(len, rollouts.current.completions))),
                           ("trained_tokens", sum(int((x != IGNORE_INDEX).sum()) for x in labels)),
                           ("real_tokens", sum(int((d >= 0).sum()) for d in documents)),
                           ("total_tokens", sum(d.numel() for d in documents))):
            out[key].append(value)
    wall, cpu, busy1 = time.perf_counter() - wall0, time.process_time() - cpu0, machine_busy_seconds()
    return out | {"layout": opts.layout, "wall_s": wall, "own_cpu_s": cpu,
                  "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.grpo")
    p.add_argument("--layout", choices=["packed", "padded"], default="packed",
                   help="completions packed whole into windows, or one per row padded to the microbatch's longest")
    p.add_argument("--flavor", default="debugmodel", help="the model (tiny: a seconds-long smoke run)")
    p.add_argument("--local_batch", type=int, default=16, help="completions per microbatch")
    p.add_argument("--max_new", type=int, default=MAX_NEW, help="grpo.max_completion_length")
    p.add_argument("--seq_len", type=int, default=256, help="training.seq_len (a prompt and its completion fit it)")
    p.add_argument("--most_words", type=int, default=60, help="the longest prompt's words (smoke runs: a few)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    logging.getLogger("titan_lite").setLevel(logging.WARNING)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="titan_lite_grpo_bench_") as folder:
        result = run(opts, Path(folder))
    result.update(rank=0, world=1, peak_rss_bytes=peak_rss_bytes())
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
