"""Show what a run trains on: the first training samples of a config as text, the tokens that carry a loss marked
[[like this]], each packed document on its own line; the packing efficiency (trained and non-padding tokens out of
all the tokens the model processes); and with --jsonl one JSON line per sample: input_ids, labels (-100 where
nothing is trained) and, when samples are packed documents (attn_mask_type block_causal), position_ids and
document_ids. A user debugging a chat template sees exactly what trains.

    .venv/bin/python scripts/show_data.py --config train_configs/chat_lora_cpu.toml --count 2
    .venv/bin/python scripts/show_data.py --config my_run.toml --jsonl samples.jsonl --count 100 \\
        --training.seq_len 4096

Arguments after the options are config overrides, as for run_train.sh. The last line printed states the efficiency.
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.config import parse_args as parse_job_args
from titan_lite.config import validate
from titan_lite.data.dataloader import build_section_source
from titan_lite.data.datasets import document_positions
from titan_lite.data.instruct import PAD_DOCUMENT
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.errors import ConfigError
from titan_lite.job.cli import ScriptParser
from titan_lite.job.outputs import check_output_file
from titan_lite.job.plan import build_model_args, tokenizer_path
from titan_lite.job.script import run_script
from titan_lite.loss import IGNORE_INDEX

OPEN, CLOSE = "[[", "]]"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = ScriptParser(__doc__)
    parser.add_argument("--config", required=True, help="the run's TOML (its [training] data, tokenizer, [instruct])")
    parser.add_argument("--count", type=int, default=3, help="samples printed (and written with --jsonl)")
    parser.add_argument("--jsonl", help="also write the first --count samples as JSON lines to this file")
    parser.add_argument("--scan", type=int, default=1000,
                        help="samples the packing efficiency is measured over (0 = one whole epoch)")
    return parser.parse_known_args(argv)


def sample_lines(tokenizer, inputs: list[int], labels: list[int], documents: list[int] | None) -> list[str]:
    """The sample as text: a line per document (a packed window's padding as a count), trained tokens in [[ ]]."""
    tokens = inputs + ([labels[-1]] if labels[-1] != IGNORE_INDEX else [])
    trained = [False] + [label != IGNORE_INDEX for label in labels]  # token j trains when labels[j - 1] is set
    docs = (documents + documents[-1:]) if documents is not None else [0] * len(tokens)
    lines = []
    for doc, group in itertools.groupby(range(len(tokens)), key=lambda j: docs[j]):
        members = list(group)
        if documents is not None and doc == PAD_DOCUMENT:
            lines.append(f"[padding: {len(members)} tokens]")
            continue
        text = "".join(_marked(tokenizer.decode([tokens[j] for j in run]), is_trained)
                       for is_trained, run in itertools.groupby(members, key=lambda j: trained[j]))
        lines.append(f"[document {doc}] {text}" if documents is not None else text)
    return lines


def _marked(text: str, is_trained: bool) -> str:
    return f"{OPEN}{text}{CLOSE}" if is_trained else text


class Efficiency:
    """Tokens the model processes, those that are not padding, and those that carry a loss. Unpacked samples are
    padded to the longest of each batch of training.local_batch_size, as the trainer's loader pads them."""

    def __init__(self, batch: int, padded: bool):
        self.batch, self.padded = batch, padded
        self.total = self.real = self.trained = self.samples = 0
        self._lengths: list[int] = []

    def add(self, inputs, labels, documents) -> None:
        self.samples += 1
        self.trained += int((labels != IGNORE_INDEX).sum())
        if self.padded:
            self._lengths.append(inputs.numel())
            if len(self._lengths) == self.batch:
                self.flush()
            return
        self.total += inputs.numel()
        self.real += inputs.numel() if documents is None else int((documents != PAD_DOCUMENT).sum())

    def flush(self) -> None:
        if self._lengths:
            self.total += len(self._lengths) * max(self._lengths)
            self.real += sum(self._lengths)
            self._lengths = []

    def line(self) -> str:
        self.flush()
        total = max(self.total, 1)
        return (f"packing efficiency over {self.samples} samples ({self.total:,} tokens): {self.trained:,} trained "
                f"({100 * self.trained / total:.1f}%), {self.real:,} not padding ({100 * self.real / total:.1f}%)")


def show(opts: argparse.Namespace, overrides: list[str]) -> str:
    if opts.count < 0 or opts.scan < 0:
        raise ConfigError("--count and --scan must be at least 0")
    if opts.jsonl:
        check_output_file("--jsonl", opts.jsonl)
    cfg = parse_job_args(["--job.config_file", opts.config, *overrides])
    validate(cfg)
    tokenizer = build_tokenizer(tokenizer_path(cfg))
    documents = build_model_args(cfg, tokenizer.vocab_size).attn_mask_type == "block_causal"
    source = build_section_source(cfg, "training", tokenizer, infinite=False, documents=documents)
    padded = cfg.training.dataset == "instruct" and not cfg.instruct.packing
    efficiency = Efficiency(cfg.training.local_batch_size, padded)
    records, last_report = [], time.monotonic()
    for index, (sample, _) in enumerate(source.samples()):
        if index >= max(opts.count, opts.scan) and opts.scan:
            break
        inputs, labels, *rest = sample
        docs = sample_documents(inputs, rest, documents)
        efficiency.add(inputs, labels, docs)
        if index < opts.count:
            print_sample(index, tokenizer, inputs, labels, docs)
            records.append(sample_record(inputs, labels, docs))
        if time.monotonic() - last_report > 10:
            print(f"measuring: {index + 1} samples read", flush=True)
            last_report = time.monotonic()
    if opts.jsonl:
        Path(opts.jsonl).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.jsonl).write_text("".join(json.dumps(r) + "\n" for r in records))
    written = f"; {len(records)} samples written to {opts.jsonl}" if opts.jsonl else ""
    return efficiency.line() + written


def sample_documents(inputs: torch.Tensor, rest: list, block_causal: bool) -> torch.Tensor | None:
    """The document id of each token under block-causal attention: the packed windows' own, or, for a sample that
    is one unpacked example (instruct.packing = false), document 0 throughout (it attends within itself, as
    training runs it); None under causal attention."""
    if not block_causal:
        return None
    return rest[0] if rest else torch.zeros_like(inputs)


def print_sample(index: int, tokenizer, inputs, labels, documents) -> None:
    trained = int((labels != IGNORE_INDEX).sum())
    count = len(set(documents.tolist()) - {PAD_DOCUMENT}) if documents is not None else 0
    packed = f", {count} document{'s' * (count != 1)}" if documents is not None else ""
    print(f"--- sample {index + 1}: {inputs.numel()} tokens{packed}, {trained} trained", flush=True)
    docs = documents.tolist() if documents is not None else None
    for line in sample_lines(tokenizer, inputs.tolist(), labels.tolist(), docs):
        print(line, flush=True)


def sample_record(inputs, labels, documents) -> dict:
    record = {"input_ids": inputs.tolist(), "labels": labels.tolist()}
    if documents is not None:
        record |= {"position_ids": document_positions(documents).tolist(), "document_ids": documents.tolist()}
    return record


def main(argv: list[str] | None = None) -> int:
    opts, overrides = parse_args(argv)
    return run_script(lambda: print(show(opts, overrides), flush=True))


if __name__ == "__main__":
    sys.exit(main())
