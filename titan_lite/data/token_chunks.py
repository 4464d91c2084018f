"""What a tokenizing worker process runs (light: text workers start without torch): records turned into token ids
and masks (RecordEncoder), and a chunk of them written as its shard files, the chunk's record last."""

import functools
import json
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from titan_lite.data.chat import ChatEncoder, Conversation, load_chat_template
from titan_lite.data.token_files import Encoded, EncodedArrays, capacity, shard_file
from titan_lite.data.tokenizer import Tokenizer
from titan_lite.errors import ConfigError


@dataclass
class RecordEncoder:
    """Turns records of one kind into tokens; picklable (each worker process builds its chat template itself)."""

    kind: str
    tokenizer: Tokenizer
    settings: Any = None  # [instruct] or [preference] (config.schema.Instruct / Preference)
    folder: Path | None = None  # the tokenizer folder, where a chat template named 'tokenizer' lives

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_encoder"}

    def encode(self, row: int, record: Any) -> Encoded:
        if self.kind == "text":
            return Encoded([self.tokenizer.encode(record, bos=True, eos=True)])
        if getattr(self, "_encoder", None) is None:
            self._encoder = build_record_format(self.kind, self.tokenizer, self.settings, self.folder)
        return self._encoder(row, record)


def build_record_format(kind: str, tokenizer: Tokenizer, settings: Any, folder: Path | None):
    """(row, record) -> Encoded with the InstructFormat (chat or instruct) or PairEncoder (preference) of these
    settings."""
    # imported here: rows need the instruction and preference modules (and torch); text workers start without them
    from titan_lite.data.instruct import InstructFormat, encoded_record  # (rows only, see above)
    from titan_lite.data.preference import PairEncoder, encoded_pair  # (rows only, see above)

    key = "preference.chat_template" if kind == "preference" else "instruct.chat_template"
    chat = None
    if settings.chat_template:
        template = load_chat_template(settings.chat_template, folder, tokenizer, key=key)
        chat = ChatEncoder(template, tokenizer) if kind == "preference" else \
            ChatEncoder(template, tokenizer, settings.train_on)
    if kind == "preference":
        return functools.partial(encoded_pair, PairEncoder(tokenizer, chat, key))
    return functools.partial(encoded_record, InstructFormat(settings, tokenizer, chat))


@dataclass
class Chunk:
    """Consecutive records of the input: the unit of work, of a shard, and of resuming."""

    index: int
    first_row: int
    records: list[Any]
    chars: int
    input_bytes: int = 0  # of the input files (uncompressed) its records were read from, where the reader knows it


class Tally:
    """The characters and tokens every process has encoded so far in this run, in shared memory: the progress line
    reads it while chunks are still being tokenized (a chunk of 64 MB takes a while)."""

    EVERY = 0.5  # seconds between a worker's additions

    def __init__(self, context: Any = multiprocessing):
        self._values = context.Array("q", 2)

    def add(self, chars: int, tokens: int) -> None:
        with self._values.get_lock():
            self._values[0] += chars
            self._values[1] += tokens

    def read(self) -> tuple[int, int]:
        with self._values.get_lock():
            return self._values[0], self._values[1]


_WORKER_ENCODER: RecordEncoder | None = None
_WORKER_TALLY: Tally | None = None
_ON_TALLY: Callable[[], None] | None = None  # in the main process: the progress line, after each addition


def start_worker(encoder: RecordEncoder, tally: Tally | None = None,
                 on_tally: Callable[[], None] | None = None) -> None:
    global _WORKER_ENCODER, _WORKER_TALLY, _ON_TALLY
    _WORKER_ENCODER, _WORKER_TALLY, _ON_TALLY = encoder, tally, on_tally


def _encoded_records(chunk: Chunk) -> list[Encoded]:
    """The chunk's records encoded, added to the tally about every Tally.EVERY seconds and at the end."""
    out: list[Encoded] = []
    chars = tokens = 0
    last = time.perf_counter()
    for i, record in enumerate(chunk.records):
        out.append(_WORKER_ENCODER.encode(chunk.first_row + i, record))
        if _WORKER_TALLY is None:
            continue
        chars += record_chars(record)
        tokens += sum(len(ids) for ids in out[-1].documents)
        now = time.perf_counter()
        if now - last >= Tally.EVERY or i == len(chunk.records) - 1:
            _WORKER_TALLY.add(chars, tokens)
            chars = tokens = 0
            last = now
            if _ON_TALLY is not None:
                _ON_TALLY()
    return out


def record_chars(record: Any) -> int:
    """The characters of a record's text (what a chunk's size and the progress count)."""
    if isinstance(record, str):
        return len(record)
    if isinstance(record, Conversation):
        return sum(len(text) for _, text in record.turns)
    if hasattr(record, "response"):  # an instruct Example (instruct.py imports torch: not imported here)
        return len(record.prompt) + len(record.response)
    parts = (record.prompt, record.chosen, record.rejected)
    return sum(len(p) if isinstance(p, str) else sum(len(text) for _, text in p) for p in parts)


def tokenize_chunk(folder: Path, chunk: Chunk, dtype: str) -> dict[str, int]:
    """Tokenize a chunk (in a worker) into its shard files, the record of it written last: a chunk whose record is
    there is whole."""
    arrays = EncodedArrays.of(_encoded_records(chunk))
    ids = arrays.ids
    if len(ids) and int(ids.max()) >= capacity(dtype):
        raise ConfigError(f"token id {int(ids.max()):,} does not fit {dtype}: the tokenizer's vocabulary is larger "
                          "than it says")
    ids.astype(dtype).tofile(folder / shard_file(chunk.index))
    if arrays.masks is not None:
        arrays.masks.tofile(folder / shard_file(chunk.index, "mask"))
    arrays.lengths.tofile(folder / f"chunk-{chunk.index:05d}.lengths")
    for name, values in arrays.records.items():
        values.tofile(folder / f"chunk-{chunk.index:05d}.{name}")
    done = {"documents": len(arrays.lengths), "tokens": len(ids), "records": len(chunk.records), "chars": chunk.chars,
            "max_id": int(ids.max()) if len(ids) else -1}
    (folder / f"chunk-{chunk.index:05d}.json").write_text(json.dumps(done))
    return done


def finished_chunk(folder: Path, index: int, dtype: str) -> dict[str, int] | None:
    """A chunk an earlier run finished (its record there, its shard of the size it says), else None."""
    path = folder / f"chunk-{index:05d}.json"
    try:
        done = json.loads(path.read_text())
        size = (folder / shard_file(index)).stat().st_size
    except (OSError, ValueError):
        return None
    return done if size == done["tokens"] * np.dtype(dtype).itemsize else None
