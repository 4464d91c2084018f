"""LoRA step time against full fine-tuning: the trainer's own train_step on the same model, batch and device, one
process. Prints one line per mode and, last, the ratio.

    python benchmarks/lora_step_time.py --flavor debugmodel --batch 8 --seq 256 --steps 10
    python benchmarks/lora_step_time.py --flavor 1B --batch 2 --seq 2048 --lora "--lora.rank 32 --lora.alpha 64"
"""

import argparse
import shlex
import statistics
import sys
import tempfile
import time

import torch

from titan_lite import distributed as tl_dist
from titan_lite.config import parse_args as parse_job_args
from titan_lite.train import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--lora", default="--lora.rank 16 --lora.alpha 32",
                        help="[lora] overrides of the LoRA run (all seven projections by default)")
    parser.add_argument("--extra", default="", help="overrides for both runs, e.g. '--compile.enable'")
    return parser.parse_args(argv)


def step_seconds(opts: argparse.Namespace, lora: bool, folder: str) -> float:
    """Median seconds of the trainer's train_step (forward, backward, clip, optimizer step)."""
    argv = ["--model.flavor", opts.flavor, "--training.local_batch_size", str(opts.batch), "--training.seq_len",
            str(opts.seq), "--job.dump_folder", folder, "--activation_checkpoint.mode", "none",
            *shlex.split(opts.extra)]
    if lora:
        argv += ["--model.converters", "lora", *shlex.split(opts.lora)]
    trainer = Trainer(parse_job_args(argv))
    data = iter(trainer.dataloader)
    batches = [trainer.next_microbatches(data) for _ in range(opts.steps + 2)]
    times = []
    for step, batch in enumerate(batches, start=1):
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(batch, step)  # returns the loss as a float: the step has finished
        times.append(time.perf_counter() - start)
    trainer.metrics.close()
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        full = step_seconds(opts, lora=False, folder=folder)
        lora = step_seconds(opts, lora=True, folder=folder)
    device = tl_dist.local_device()
    where = f"{opts.flavor}, batch {opts.batch} x {opts.seq} tokens, {device.type}, {torch.get_num_threads()} threads"
    print(f"full fine-tuning step: {full * 1e3:.1f} ms ({where})")
    print(f"LoRA step:             {lora * 1e3:.1f} ms ({opts.lora})")
    print(f"LoRA / full fine-tuning step time: {lora / full:.2f}")
    tl_dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
