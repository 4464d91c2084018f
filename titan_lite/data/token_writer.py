"""Writes token files (token_files.py's format) from what training.dataset_path reads: documents of .txt, .jsonl,
.json.gz and .parquet shards (with bos and eos, as packing reads them), or chat, instruction and preference rows (ids
and trained-token masks; a pair as its two sequences). Chunks of the input are tokenized by N processes, each chunk
a shard of its own that an interrupted run keeps: the same command resumes from there. Everything is written into a
partial folder first and appears under its name only when whole."""

import json
import logging
import multiprocessing
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from titan_lite.data import token_chunks
from titan_lite.data.chat import Conversation
from titan_lite.data.datasets import DocumentStream, StreamPosition, shards_at
from titan_lite.data.instruct import Example, InstructionFile
from titan_lite.data.preference import PreferenceFile
from titan_lite.data.token_chunks import Chunk, RecordEncoder, finished_chunk, start_worker
from titan_lite.data.token_files import (
    FORMAT,
    KINDS,
    MANIFEST,
    OFFSETS,
    RECORD_ARRAYS,
    VERSION,
    dtype_for,
    encoding_settings,
)
from titan_lite.data.tokenizer import tokenizer_fingerprint
from titan_lite.errors import ConfigError, quote_path
from titan_lite.folders import partial_folder, swap_in

logger = logging.getLogger(__name__)
PLAN = "plan.json"  # in the partial folder: what it is being written from (a resumed run must match it)


# ---------------------------------------------------------------- records and their tokens


def read_records(kind: str, paths: list[str], settings: Any = None) -> Iterator[Any]:
    """The records of the inputs in order: documents' texts, or the rows of chat, instruction or preference files
    (one file or saved `datasets` folder each)."""
    if kind == "text":
        shards = [shard for path in paths for shard in shards_at(Path(path), "--data")]
        for text, _ in DocumentStream(shards).read(StreamPosition()):
            yield text
        return
    reader = PreferenceFile if kind == "preference" else InstructionFile
    for path in paths:
        for _, record in reader(Path(path), settings, "--data").examples():
            yield record


def record_chars(record: Any) -> int:
    """The characters of a record's text (what a chunk's size and the progress count)."""
    if isinstance(record, str):
        return len(record)
    if isinstance(record, Example):
        return len(record.prompt) + len(record.response)
    if isinstance(record, Conversation):
        return sum(len(text) for _, text in record.turns)
    parts = (record.prompt, record.chosen, record.rejected)
    return sum(len(p) if isinstance(p, str) else sum(len(text) for _, text in p) for p in parts)


# ---------------------------------------------------------------- chunks


def chunks(records: Iterator[Any], chunk_chars: int) -> Iterator[Chunk]:
    """Consecutive records cut into chunks of about `chunk_chars` characters (the same cut for the same input)."""
    batch, chars, index, row = [], 0, 0, 0
    for record in records:
        batch.append(record)
        chars += record_chars(record)
        if chars >= chunk_chars:
            yield Chunk(index, row, batch, chars)
            index, row, batch, chars = index + 1, row + len(batch), [], 0
    if batch:
        yield Chunk(index, row, batch, chars)


# ---------------------------------------------------------------- the folder


@dataclass
class Progress:
    """Prints how far the tokenizing is, at most every `every` seconds: text done, tokens, rate and ETA."""

    total_chars: int
    report: Callable[[str], None]
    every: float = 5.0
    chars: int = 0
    tokens: int = 0
    new_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    last: float = 0.0

    def add(self, done: dict[str, int], new: bool) -> None:
        self.chars += done["chars"]
        self.tokens += done["tokens"]
        self.new_tokens += done["tokens"] if new else 0
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self.report(self.line())

    def rate(self) -> float:
        return self.new_tokens / max(time.perf_counter() - self.start, 1e-9)

    def line(self) -> str:
        share = min(self.chars / max(self.total_chars, 1), 0.99)
        elapsed = time.perf_counter() - self.start
        eta = elapsed * (1 - share) / share if share > 0 and self.new_tokens else float("nan")
        return (f"tokenized {share:.0%} (about {self.chars / 1e6:,.1f} of {self.total_chars / 1e6:,.1f} MB of text), "
                f"{self.tokens:,} tokens, {self.rate():,.0f} tokens/s, ETA {_duration(eta)}")


def _duration(seconds: float) -> str:
    if seconds != seconds:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{secs:02d}s"


def source_list(paths: list[str]) -> list[dict[str, Any]]:
    """Each input with its size and modification time (a resumed run reads the same files)."""
    out = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"--data {quote_path(path)} does not exist")
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        out.append({"path": str(p.resolve()), "bytes": sum(f.stat().st_size for f in files),
                    "mtime_ns": max((f.stat().st_mtime_ns for f in files), default=0)})
    return out


def write_token_folder(out: str | Path, paths: list[str], encoder: RecordEncoder, workers: int = 1,
                       chunk_chars: int | None = None, report: Callable[[str], None] = print,
                       finish: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Tokenize `paths` into the token folder `out` (which the caller checked may be written) and return its
    manifest. The folder is written as `out`'s partial folder, which an interrupted run resumes and a refused one
    removes; `finish(partial)` makes it `out` (default: titan_lite.folders.swap_in, the one rule for output
    folders)."""
    if encoder.kind not in KINDS:
        raise ConfigError(f"--kind {encoder.kind!r}; expected one of {', '.join(KINDS)}")
    out = Path(out)
    sources = source_list(paths)
    total = sum(s["bytes"] for s in sources)
    chunk_chars = chunk_chars or min(max(total // (4 * workers), 1 << 20), 64 << 20)
    dtype = dtype_for(encoder.tokenizer.vocab_size)
    plan = {"format": FORMAT, "version": VERSION, "kind": encoder.kind, "dtype": dtype, "sources": sources,
            "tokenizer": tokenizer_fingerprint(encoder.tokenizer), "chunk_chars": chunk_chars,
            "settings": encoding_settings(encoder.kind, encoder.settings, encoder.folder, encoder.tokenizer)}
    partial = _partial_for(out, plan, report)
    progress = Progress(total, report)
    try:
        done = _tokenize_all(partial, read_records(encoder.kind, paths, encoder.settings), encoder, workers, plan,
                             progress)
        manifest = _finalize(partial, plan, done)
    except ConfigError:
        shutil.rmtree(partial, ignore_errors=True)  # refused inputs: the same ones would be refused again
        raise
    try:
        (finish or (lambda ready: swap_in("the token folder", ready, out)))(partial)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; the finished token folder stays in {quote_path(partial)}: run the same command "
                          "again once the folder may be replaced") from None
    manifest["tokens_per_second"] = progress.rate()
    return manifest


def _partial_for(out: Path, plan: dict[str, Any], report: Callable[[str], None]) -> Path:
    """The partial folder: an earlier run's of the same plan is kept (resumed), any other one is cleared."""
    partial = partial_folder(out)
    try:
        earlier = json.loads((partial / PLAN).read_text())
    except (OSError, ValueError):
        earlier = None
    if earlier == plan:
        count = len(list(partial.glob("chunk-*.json")))
        report(f"resuming the interrupted run in {quote_path(partial)}: {count} chunk(s) done")
        return partial
    if partial.exists():
        report(f"restarting: {quote_path(partial)} holds an interrupted run of other inputs or settings")
        shutil.rmtree(partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()
    (partial / PLAN).write_text(json.dumps(plan))
    return partial


def _tokenize_all(partial: Path, records: Iterator[Any], encoder: RecordEncoder, workers: int,
                  plan: dict[str, Any], progress: Progress) -> list[dict[str, int]]:
    """Tokenize every chunk not finished before, `workers` at a time (a few queued per worker, so reading stays
    just ahead of tokenizing); the chunks' records in order."""
    done: dict[int, dict[str, int]] = {}
    dtype = plan["dtype"]
    start_worker(encoder)
    pool = _pool(workers, encoder) if workers > 1 else None
    pending: deque = deque()
    try:
        for chunk in chunks(records, plan["chunk_chars"]):
            earlier = finished_chunk(partial, chunk.index, dtype)
            if earlier is not None:
                done[chunk.index] = earlier
                progress.add(earlier, new=False)
                continue
            if pool is None:
                done[chunk.index] = token_chunks.tokenize_chunk(partial, chunk, dtype)
                progress.add(done[chunk.index], new=True)
                continue
            pending.append((chunk.index, pool.apply_async(token_chunks.tokenize_chunk, (partial, chunk, dtype))))
            while len(pending) >= 2 * workers:
                _collect(pending, done, progress)
        while pending:
            _collect(pending, done, progress)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    if not done:
        raise ConfigError(f"--data {', '.join(s['path'] for s in plan['sources'])} holds no "
                          f"{'documents' if plan['kind'] == 'text' else 'rows'}")
    return [done[i] for i in range(len(done))]


def _pool(workers: int, encoder: RecordEncoder):
    """Worker processes from a forkserver (never a fork of a process with threads), each importing only the light
    token_chunks: they are started without the caller's __main__, whose imports (torch) would cost seconds per worker
    on a busy machine. (Nothing is preloaded into the forkserver: Python 3.11's does so before it takes the caller's
    sys.path, and could import another installed titan_lite than the caller's.)"""
    context = multiprocessing.get_context("forkserver")
    main = sys.modules["__main__"]
    saved = {name: main.__dict__.pop(name) for name in ("__spec__", "__file__") if name in main.__dict__}
    try:
        main.__spec__ = None  # what multiprocessing reads to import the main module in each worker
        return context.Pool(workers, start_worker, (encoder,))
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _collect(pending: deque, done: dict[int, dict[str, int]], progress: Progress) -> None:
    index, result = pending.popleft()
    done[index] = result.get()
    progress.add(done[index], new=True)


def _finalize(partial: Path, plan: dict[str, Any], done: list[dict[str, int]]) -> dict[str, Any]:
    """The global index and record arrays from the chunks' pieces, then the manifest (written last)."""
    lengths = [np.fromfile(partial / f"chunk-{i:05d}.lengths", dtype=np.int64) for i in range(len(done))]
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
    offsets.tofile(partial / OFFSETS)
    arrays = []
    for name, dtype_name in RECORD_ARRAYS.items():
        pieces = [partial / f"chunk-{i:05d}.{name}" for i in range(len(done))]
        if pieces[0].exists():
            np.concatenate([np.fromfile(p, dtype=dtype_name) for p in pieces]).tofile(partial / f"{name}.{dtype_name}")
            arrays.append(name)
    manifest = {k: v for k, v in plan.items() if k != "chunk_chars"} | {
        "documents": len(offsets) - 1, "tokens": int(offsets[-1]), "records": sum(d["records"] for d in done),
        "record_arrays": arrays, "shards": [{"tokens": d["tokens"], "documents": d["documents"]} for d in done]}
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for piece in [*partial.glob("chunk-*"), partial / PLAN]:  # after the manifest: a crash before here resumes
        piece.unlink()
    return manifest
