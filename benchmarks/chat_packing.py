"""Chat fine-tuning throughput: trained (useful) tokens per second of the trainer's steps on conversations with a
realistic length mix (many short, few long), one conversation per padded sequence against conversations packed
whole into windows with block-causal attention; and the block mask's cost against plain causal attention on the
very same packed windows (equal tokens).

Run by benchmarks/run.py (the `chat_packing` case); by hand:

    python -m benchmarks.chat_packing --layout packed --steps 6 --warmup 2

The conversations are prompt/response pairs of Shakespeare's words in the bundled tokenizer's ChatML-free prompt
template; lengths are drawn from a fixed log-uniform mix: ~75% of them under 256 tokens, ~5% over 768 (the
shape of typical SFT data), a seeded file so every variant reads the same examples. The result line is
benchmarks.worker's, with trained_per_step (tokens carrying a loss) and real_per_step (not padding).
"""

import argparse
import json
import logging
import math
import random
import sys
import tempfile
from pathlib import Path

from benchmarks.worker import RESULT_PREFIX, measure, peak_rss_bytes
from titan_lite.config import parse_args
from titan_lite.data.batch import Batch
from titan_lite.loss import IGNORE_INDEX
from titan_lite.metrics.flops import num_flops_per_token
from titan_lite.train import Trainer

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 1024
# layout: (local batch, overrides). Packed windows hold 1,024 tokens; the padded batch holds as many conversations
# as 2 windows do on average (with the mix below: ~4.6 per window), padded to its longest.
LAYOUTS = {
    "packed": (2, ["--instruct.packing", "--model.attn_mask_type", "block_causal"]),
    "packed_causal": (2, ["--instruct.packing", "--model.attn_mask_type", "block_causal"]),  # document ids dropped
    "padded": (9, ["--instruct.packing=false", "--model.attn_mask_type", "causal"]),
}


def length_mix(count: int, seed: int) -> list[int]:
    """Conversation lengths in words, log-uniform between 24 and 900: many short, few long."""
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(24), math.log(900)))) for _ in range(count)]


def write_conversations(path: Path, count: int = 600, seed: int = 0) -> Path:
    """Prompt/response pairs whose word counts follow length_mix; the response is 40% of the words."""
    words = (REPO / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text().split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for n in length_mix(count, seed):
            start = rng.randrange(len(words) - n)
            cut = max(1, int(n * 0.6))
            f.write(json.dumps({"question": " ".join(words[start:start + cut]),
                                "answer": " ".join(words[start + cut:start + n])}) + "\n")
    return path


def chat_step(layout: str, folder: Path, batches: int):
    local_batch, overrides = LAYOUTS[layout]
    data = write_conversations(folder / "chat.jsonl")
    cfg = parse_args(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--model.flavor",
                      "debugmodel", "--model.hf_assets_path", str(REPO / "assets/tokenizer"),
                      "--training.dataset", "instruct", "--training.dataset_path", str(data),
                      "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(local_batch),
                      "--validation.enable=false", "--metrics.enable_tensorboard=false", "--job.dump_folder",
                      str(folder / "out"), "--lr_scheduler.warmup_steps", "0", *overrides])
    trainer = Trainer(cfg)
    data_iter = iter(trainer.dataloader)
    prefetched = [trainer.next_microbatches(data_iter) for _ in range(batches)]  # read before timing
    if layout == "packed_causal":  # the same windows, attended causally: what the block mask costs at equal tokens
        prefetched = [[Batch(batch.inputs, batch.labels) for batch in mb] for mb in prefetched]

    def step(i: int) -> float:
        loss, _ = trainer.train_step(prefetched[i % len(prefetched)], i + 1)
        return loss

    a = trainer.plan.model_args
    flops = num_flops_per_token(trainer.plan.full_param_count(), a.vocab_size * a.dim, a.n_layers, a.n_heads,
                                a.head_dim, SEQ_LEN)
    trained = [sum(int((batch.labels != IGNORE_INDEX).sum()) for batch in mb) for mb in prefetched]
    total = [sum(batch.inputs.numel() for batch in mb) for mb in prefetched]
    pad_id = trainer.plan.tokenizer.eos_id
    real = [sum(int((batch.inputs != pad_id).sum()) for batch in mb) for mb in prefetched]
    return step, trained, total, real, flops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chat_packing",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    opts = p.parse_args(argv)
    logging.getLogger("titan_lite").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="titan_lite_chat_bench_") as folder:
        n = opts.steps + opts.warmup
        step, trained, total, real, flops = chat_step(opts.layout, Path(folder), n)
        result = measure(step, opts.steps, opts.warmup)
    timed = range(opts.warmup, n)
    result.update(layout=opts.layout, rank=0, world=1, peak_rss_bytes=peak_rss_bytes(), flops_per_token=flops,
                  trained_per_step=[trained[i] for i in timed], total_per_step=[total[i] for i in timed],
                  real_per_step=[real[i] for i in timed])
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
