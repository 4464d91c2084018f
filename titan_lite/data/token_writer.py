"""Writes token files (token_files.py's format) from what training.dataset_path reads: documents of .txt, .jsonl,
.json.gz and .parquet shards (with bos and eos, as packing reads them), or chat, instruction and preference rows (ids
and trained-token masks; a pair as its two sequences). Chunks of the input are tokenized by N processes, each chunk
a shard of its own that an interrupted run keeps: the same command resumes from there. Everything is written into a
partial folder first and appears under its name only when whole."""

import functools
import itertools
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
from titan_lite.data.datasets import DocumentStream, StreamPosition, shards_at
from titan_lite.data.instruct import InstructionFile
from titan_lite.data.preference import PreferenceFile
from titan_lite.data.token_chunks import Chunk, RecordEncoder, Tally, finished_chunk, record_chars, start_worker
from titan_lite.data.token_files import (
    FORMAT,
    KINDS,
    MANIFEST,
    OFFSETS,
    PLAN,
    RECORD_ARRAYS,
    VERSION,
    dtype_for,
    encoding_settings,
    largest_id,
    shard_file,
)
from titan_lite.data.tokenizer import tokenizer_fingerprint
from titan_lite.errors import ConfigError, quote_path
from titan_lite.folders import partial_folder, swap_in

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- records and their tokens


@dataclass
class InputCursor:
    """How many bytes of the input files (a .json.gz's uncompressed) the records read so far came from, and how many
    of the documents among them are empty (blank)."""

    bytes: int = 0
    documents: int = 0
    empty: int = 0


def read_records(kind: str, paths: list[str], settings: Any = None,
                 cursor: InputCursor | None = None) -> Iterator[Any]:
    """The records of the inputs in order: documents' texts (moving `cursor` on), or the rows of chat, instruction or
    preference files (one file or saved `datasets` folder each)."""
    if kind == "text":
        shards = text_shards(paths)
        before = [0, *itertools.accumulate(input_size(s) for s in shards)]
        for text, at in DocumentStream(shards).read(StreamPosition()):
            if cursor is not None:
                cursor.bytes = before[at.shard] + _bytes_into(shards[at.shard], at)
                cursor.documents += 1
                cursor.empty += not text.strip()
            yield text
        return
    reader = PreferenceFile if kind == "preference" else InstructionFile
    for path in paths:
        for _, record in reader(Path(path), settings, "--data").examples():
            yield record


def text_shards(paths: list[str]) -> list[Path]:
    return [shard for path in paths for shard in shards_at(Path(path), "--data")]


def input_size(shard: Path) -> int:
    """A text shard's bytes as its reader reads them: a .gz file's uncompressed size (its gzip trailer holds it
    modulo 4 GiB), else the file's size."""
    size = shard.stat().st_size
    if not shard.name.endswith(".gz") or size < 18:  # smaller is no gzip file: its reader says so
        return size
    with open(shard, "rb") as f:
        f.seek(-4, 2)
        unpacked = int.from_bytes(f.read(4), "little")
    while unpacked < size:  # text compresses: a trailer below the file's size wrapped around 4 GiB
        unpacked += 1 << 32
    return unpacked


def _bytes_into(shard: Path, at: StreamPosition) -> int:
    """The bytes of a shard read up to `at`: its byte offset (a parquet file's rows in proportion)."""
    if shard.suffix != ".parquet":
        return at.byte
    return shard.stat().st_size * at.line // max(_parquet_rows(shard), 1)


@functools.cache
def _parquet_rows(shard: Path) -> int:
    import pyarrow.parquet as pq  # optional dependency: only .parquet files need it (and reading one imported it)

    return pq.ParquetFile(shard).metadata.num_rows


# ---------------------------------------------------------------- chunks


def chunks(records: Iterator[Any], chunk_chars: int, cursor: InputCursor | None = None) -> Iterator[Chunk]:
    """Consecutive records cut into chunks of about `chunk_chars` characters (the same cut for the same input); each
    with the input bytes its records came from, where `cursor` follows the reading."""
    batch, chars, index, row, start = [], 0, 0, 0, 0
    for record in records:
        batch.append(record)
        chars += record_chars(record)
        if chars >= chunk_chars:
            end = cursor.bytes if cursor is not None else 0
            yield Chunk(index, row, batch, chars, end - start)
            index, row, batch, chars, start = index + 1, row + len(batch), [], 0, end
    if batch:
        yield Chunk(index, row, batch, chars, (cursor.bytes if cursor is not None else 0) - start)


# ---------------------------------------------------------------- the folder


@dataclass
class Progress:
    """Prints how far the tokenizing is, at most every `every` seconds and from the first records on (the tally the
    processes add to while a chunk is tokenized): the input read, tokens, rate and ETA."""

    total: int  # the input's bytes (text: a .json.gz's uncompressed)
    report: Callable[[str], None]
    tally: Tally
    by_input: bool = False  # whether chunks know the input bytes they were read from (text), else characters count
    every: float = 5.0
    earlier_chars: int = 0  # of the chunks an interrupted run finished
    earlier_tokens: int = 0
    read_chars: int = 0  # of every chunk read so far: their ratio turns characters encoded into input read
    read_input: int = 0
    start: float = field(default_factory=time.perf_counter)
    last: float = 0.0

    def read(self, chunk: Chunk) -> None:
        self.read_chars += chunk.chars
        self.read_input += chunk.input_bytes

    def resumed(self, done: dict[str, int]) -> None:
        self.earlier_chars += done["chars"]
        self.earlier_tokens += done["tokens"]
        self.tick()

    def tick(self) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every and (self.earlier_tokens or self.tally.read()[1]):
            self.last = now
            self.report(self.line())

    def rate(self) -> float:
        return self.tally.read()[1] / max(time.perf_counter() - self.start, 1e-9)

    def line(self) -> str:
        chars, tokens = self.tally.read()
        chars, new_tokens = chars + self.earlier_chars, tokens
        done = chars * self.read_input / self.read_chars if self.by_input and self.read_chars else chars
        share = min(done / max(self.total, 1), 0.99)
        elapsed = time.perf_counter() - self.start
        eta = elapsed * (1 - share) / share if share > 0 and new_tokens else float("nan")
        what = "input" if self.by_input else "text"
        return (f"tokenized {share:.0%} (about {done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB of {what}), "
                f"{new_tokens + self.earlier_tokens:,} tokens, {self.rate():,.0f} tokens/s, ETA {_duration(eta)}")


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
    if encoder.kind == "text":
        total = sum(input_size(shard) for shard in text_shards(paths))
    dtype = dtype_for(encoder.tokenizer.vocab_size)
    plan = {"format": FORMAT, "version": VERSION, "kind": encoder.kind, "dtype": dtype, "sources": sources,
            "tokenizer": tokenizer_fingerprint(encoder.tokenizer), "chunk_chars": chunk_chars,
            "settings": encoding_settings(encoder.kind, encoder.settings, encoder.folder, encoder.tokenizer)}
    partial = _partial_for(out, plan, report)
    try:
        done, rate = _tokenize_all(partial, paths, encoder, workers, plan, total, report)
        manifest = _finalize(partial, plan, done)
    except ConfigError:
        shutil.rmtree(partial, ignore_errors=True)  # refused inputs: the same ones would be refused again
        raise
    try:
        (finish or (lambda ready: swap_in("the token folder", ready, out)))(partial)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; the finished token folder stays in {quote_path(partial)}: run the same command "
                          "again once the folder may be replaced") from None
    manifest["tokens_per_second"] = rate
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


def _tokenize_all(partial: Path, paths: list[str], encoder: RecordEncoder, workers: int, plan: dict[str, Any],
                  total: int, report: Callable[[str], None]) -> tuple[list[dict[str, int]], float]:
    """Tokenize every chunk not finished before, `workers` at a time (a few queued per worker, so reading stays
    just ahead of tokenizing); the chunks' records in order, and the tokens per second of this run."""
    done: dict[int, dict[str, int]] = {}
    dtype = plan["dtype"]
    context = multiprocessing.get_context("forkserver") if workers > 1 else multiprocessing
    progress = Progress(total, report, Tally(context), by_input=encoder.kind == "text")
    start_worker(encoder, progress.tally, progress.tick)
    pool = _pool(workers, encoder, progress.tally) if workers > 1 else None
    pending: deque = deque()
    cursor = InputCursor()
    try:
        for chunk in chunks(read_records(encoder.kind, paths, encoder.settings, cursor), plan["chunk_chars"], cursor):
            progress.read(chunk)
            earlier = finished_chunk(partial, chunk.index, dtype)
            if earlier is not None:
                done[chunk.index] = earlier
                progress.resumed(earlier)
                continue
            if pool is None:
                done[chunk.index] = token_chunks.tokenize_chunk(partial, chunk, dtype)
                continue
            pending.append((chunk.index, pool.apply_async(token_chunks.tokenize_chunk, (partial, chunk, dtype))))
            while len(pending) >= 2 * workers:
                _collect(pending, done, progress)
        while pending:
            _collect(pending, done, progress)
    finally:
        start_worker(None)
        if pool is not None:
            pool.terminate()
            pool.join()
    sources = ", ".join(quote_path(s["path"]) for s in plan["sources"])
    if not done:
        raise ConfigError(f"--data {sources} holds no {'documents' if plan['kind'] == 'text' else 'rows'}")
    if cursor.empty and cursor.empty == cursor.documents:
        raise ConfigError(f"--data {sources} holds no text: its {cursor.documents:,} document(s) are all empty")
    if cursor.empty:
        report(f"note: {cursor.empty:,} of the {cursor.documents:,} documents are empty (blank); each is kept as bos + "
               "eos, as training on the raw files reads it")
    return [done[i] for i in range(len(done))], progress.rate()


def _pool(workers: int, encoder: RecordEncoder, tally: Tally):
    """Worker processes from a forkserver (never a fork of a process with threads), each importing only the light
    token_chunks: they are started without the caller's __main__, whose imports (torch) would cost seconds per worker
    on a busy machine. (Nothing is preloaded into the forkserver: Python 3.11's does so before it takes the caller's
    sys.path, and could import another installed titan_lite than the caller's.)"""
    context = multiprocessing.get_context("forkserver")
    main = sys.modules["__main__"]
    saved = {name: main.__dict__.pop(name) for name in ("__spec__", "__file__") if name in main.__dict__}
    try:
        main.__spec__ = None  # what multiprocessing reads to import the main module in each worker
        return context.Pool(workers, start_worker, (encoder, tally))
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _collect(pending: deque, done: dict[int, dict[str, int]], progress: Progress) -> None:
    """The oldest chunk's record, once its worker is done; the progress line meanwhile."""
    index, result = pending.popleft()
    while not result.ready():
        result.wait(Tally.EVERY)
        progress.tick()
    done[index] = result.get()


def _shard_max(partial: Path, index: int, dtype: str) -> int:
    """The largest id of a chunk resumed from a run that did not record it."""
    return largest_id([np.fromfile(partial / shard_file(index), dtype=dtype)])


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
    largest = max(d["max_id"] if "max_id" in d else _shard_max(partial, i, plan["dtype"]) for i, d in enumerate(done))
    manifest = {k: v for k, v in plan.items() if k != "chunk_chars"} | {
        "documents": len(offsets) - 1, "tokens": int(offsets[-1]), "max_id": largest,
        "records": sum(d["records"] for d in done),
        "record_arrays": arrays, "shards": [{"tokens": d["tokens"], "documents": d["documents"]} for d in done]}
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for piece in [*partial.glob("chunk-*"), partial / PLAN]:  # after the manifest: a crash before here resumes
        piece.unlink()
    return manifest
