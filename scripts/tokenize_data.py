"""Tokenize training data once into token files: a folder of memory-mapped token arrays, an index of document
boundaries and a manifest (the tokenizer's fingerprint, the sources with their sizes, token and document counts). Point
training.dataset_path (or validation.dataset_path, or a data_mixture.dataset_paths entry) at the folder: each rank,
and each of its DataLoader workers, then reads only its own samples, and training.shuffle draws a seeded order.

--kind text reads what a pre-training dataset_path reads (.txt, .jsonl, .json.gz, .parquet files or folders of them;
documents get bos and eos as packing adds them); --kind chat and --kind instruct read instruction rows (one .jsonl,
.json or .parquet file, or a saved `datasets` folder, per --data), as ids plus the mask of trained tokens; --kind
preference reads chosen/rejected pairs as their two sequences. The [instruct] or [preference] settings that decide
tokens (fields, templates, train_on) come from --job.config_file (your training TOML) and --instruct.* /
--preference.* overrides, and are kept in the manifest: a run with other settings is refused.

The folder is written under a temporary name and renamed when whole; an interrupted run (Ctrl-C, a crash) leaves the
chunks it finished there, and the same command resumes from them.

    .venv/bin/python scripts/tokenize_data.py --hf_assets_path assets/hf/Llama-3.2-1B \\
        --data /data/c4/en --output_dir data/c4_llama3 --workers 8
    .venv/bin/python scripts/tokenize_data.py --hf_assets_path data/synthetic_chat/tokenizer --kind chat \\
        --data data/synthetic_chat/train.jsonl --output_dir data/synthetic_chat/tokens
"""

import argparse
import signal
import sys
from pathlib import Path

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.config import parse_args as parse_config
from titan_lite.data.token_files import KINDS
from titan_lite.data.token_writer import RecordEncoder, source_list, write_token_folder
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.errors import USER_ERROR, ConfigError, quote_path
from titan_lite.folders import check_replaceable, partial_folder, swap_in
from titan_lite.job.cli import ScriptParser
from titan_lite.metrics.logger import init_logger

SECTIONS = ("--instruct.", "--preference.", "--job.config_file")
INTERRUPTED = 130
TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(the script's options, the [instruct] / [preference] settings and --job.config_file for the trainer's parser)."""
    parser = ScriptParser(__doc__)
    parser.add_argument("--hf_assets_path", required=True, help="the tokenizer: a folder holding tokenizer.json or "
                        "tokenizer.model (the run's model.hf_assets_path), or the file")
    parser.add_argument("--data", required=True, nargs="+", help="files or folders to tokenize, in this order")
    parser.add_argument("--output_dir", required=True, help="the token folder to write (new, empty, or written by "
                        "titan_lite)")
    parser.add_argument("--kind", default="text", choices=KINDS, help="what the data holds")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--chunk_mb", type=float, default=0, help="text per shard and per unit of resumable work, in "
                        "MB (0: a quarter of each process's share of the data, between 1 and 64 MB)")
    opts, rest = parser.parse_known_args(argv)
    unknown = [word for word in rest if word.startswith("--") and not word.startswith(SECTIONS)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (besides its own options the script takes "
                     "--job.config_file and --instruct.* / --preference.* settings)")
    return opts, rest


def encoder_of(opts, rest: list[str]) -> RecordEncoder:
    """The tokenizer and, for rows, the [instruct] or [preference] settings (chat: a chat template, by default the
    tokenizer folder's)."""
    tokenizer = build_tokenizer(opts.hf_assets_path)
    folder = Path(opts.hf_assets_path)
    folder = folder if folder.is_dir() else folder.parent
    cfg = parse_config(rest)
    if opts.kind == "text":
        return RecordEncoder("text", tokenizer)
    settings = cfg.preference if opts.kind == "preference" else cfg.instruct
    if opts.kind == "chat" and not settings.chat_template:
        settings.chat_template = "tokenizer"
    if opts.kind == "instruct" and settings.chat_template:
        raise ConfigError(f"--kind instruct uses the prompt template; 'instruct.chat_template' = "
                          f"'{settings.chat_template}' makes it --kind chat")
    return RecordEncoder(opts.kind, tokenizer, settings, folder)


class Terminated(Exception):
    """SIGTERM arrived (a scheduler's stop, `kill`): stop as Ctrl-C does, the finished chunks kept."""


def _terminated(signum, frame) -> None:
    raise Terminated


def check_distinct_inputs(paths: list[str]) -> None:
    """Each input once: a file named twice, or a file inside a folder also named, would be tokenized twice."""
    seen: dict[Path, str] = {}
    for path in paths:
        given = Path(path)
        files = sorted(f for f in given.rglob("*") if f.is_file()) if given.is_dir() else [given]
        for file in files:
            key = file.resolve()
            if key in seen:
                through = "" if seen[key] == path else f" (through '{seen[key]}' and '{path}')"
                raise ConfigError(f"--data names {quote_path(file)} twice{through}: it would be tokenized twice; "
                                  "name each input once")
            seen[key] = path


def main(argv: list[str] | None = None) -> int:
    opts, rest = parse_args(argv)
    init_logger()
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        if opts.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {opts.workers}")
        if not opts.chunk_mb >= 0:  # (NaN too)
            raise ConfigError(f"--chunk_mb must be 0 (chosen from the data's size) or more, got {opts.chunk_mb}")
        check_distinct_inputs(opts.data)
        check_replaceable("--output_dir", opts.output_dir)
        encoder = encoder_of(opts, rest)
        source_list(opts.data)  # a missing input is its one line before "tokenizing ..."
        print(f"tokenizing {', '.join(opts.data)} ({opts.kind}) with '{opts.hf_assets_path}' "
              f"({encoder.tokenizer.backend}), {opts.workers} process(es)", flush=True)
        manifest = write_token_folder(opts.output_dir, opts.data, encoder, opts.workers,
                                      int(opts.chunk_mb * 1e6) or None, lambda line: print(line, flush=True),
                                      lambda partial: swap_in("--output_dir", partial, opts.output_dir, kind=opts.kind,
                                                                     data=opts.data))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR
    except (KeyboardInterrupt, Terminated) as stop:
        how, code = ("stopped (SIGTERM)", TERMINATED) if isinstance(stop, Terminated) else \
            ("interrupted (Ctrl-C)", INTERRUPTED)
        print(f"error: {how}; the finished chunks stay in '{partial_folder(Path(opts.output_dir))}': "
              "run the same command again to resume", file=sys.stderr, flush=True)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)
    what = "documents" if opts.kind == "text" else f"{opts.kind} rows ({manifest['documents']:,} sequences)"
    count = manifest["documents"] if opts.kind == "text" else manifest["records"]
    print(f"wrote {opts.output_dir}: {manifest['tokens']:,} tokens in {count:,} {what}, {manifest['dtype']}, "
          f"{len(manifest['shards'])} shard(s); {manifest['tokens_per_second']:,.0f} tokens/s with {opts.workers} "
          "process(es)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
