"""Document sources (bundled Shakespeare, local .txt/.jsonl/.json.gz/.parquet shards) and token packing into a sample
stream, its documents encoded in order by one thread, or by several side by side (a raw-text DataLoader's workers)."""

import dataclasses
import functools
import gzip
import json
import logging
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch

from titan_lite.errors import ConfigError, did_you_mean, pip_install, quote_path
from titan_lite.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
BUNDLED_DATASETS = {
    "shakespeare": CORPUS_DIR / "shakespeare" / "train",
    "shakespeare_validation": CORPUS_DIR / "shakespeare" / "validation",
}
LOCAL_DATASETS = ("c4", "c4_test", "c4_validation", "jsonl", "text")
SHARD_SUFFIXES = (".txt", ".jsonl", ".json.gz", ".parquet")


class TokenizerLike(Protocol):
    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]: ...


def known_datasets() -> list[str]:
    return sorted([*BUNDLED_DATASETS, *LOCAL_DATASETS])


# ---------------------------------------------------------------- locating shards


def _is_shard(path: Path) -> bool:
    return path.name.endswith(SHARD_SUFFIXES)


def dataset_root(dataset: str, dataset_path: str | None, key_prefix: str) -> Path:
    """The file or folder a dataset reads; a given dataset_path overrides the bundled corpus."""
    if dataset not in BUNDLED_DATASETS and dataset not in LOCAL_DATASETS:
        names = known_datasets() + (["instruct", "preference", "prompts"] if key_prefix in ("training", "validation")
                                    else [])
        raise ConfigError(f"'{key_prefix}.dataset' = '{dataset}' is unknown{did_you_mean(dataset, names)}; "
                          f"known datasets: {', '.join(names)}")
    if dataset_path is not None:
        return Path(dataset_path)
    if dataset in BUNDLED_DATASETS:
        return BUNDLED_DATASETS[dataset]
    raise ConfigError(
        f"dataset '{dataset}' needs '{key_prefix}.dataset_path': titan_lite reads local shards only "
        f"(no downloads); set {key_prefix}.dataset_path to a .txt/.jsonl/.json.gz/.parquet file or a folder of them"
    )


def shards_at(root: Path, key: str) -> list[Path]:
    """The shard files of a file or folder, sorted; `key` names the config key that gave the path in errors."""
    if not root.exists():
        raise ConfigError(f"'{key}' = {quote_path(root)} does not exist")
    if root.is_file():
        if not _is_shard(root):
            raise ConfigError(f"'{key}' = '{root}' must end in one of {', '.join(SHARD_SUFFIXES)}")
        return [root]
    shards = sorted(p for p in root.iterdir() if p.is_file() and _is_shard(p))
    if not shards:
        raise ConfigError(f"'{key}' = '{root}' holds no {', '.join(SHARD_SUFFIXES)} files")
    return shards


def resolve_shards(dataset: str, dataset_path: str | None, key_prefix: str = "training") -> list[Path]:
    """The shard files of a dataset, in the order their documents are read."""
    return shards_at(dataset_root(dataset, dataset_path, key_prefix), f"{key_prefix}.dataset_path")


def check_dataset(dataset: str, dataset_path: str | None, key_prefix: str = "training") -> None:
    """Config-time validation: known name, a path where one is needed, that the path holds shards, and that they
    hold a document (reading up to the first one: an empty dataset or a malformed first line is found here; a
    malformed line further on stops the run when it is read, naming the file and line)."""
    shards = resolve_shards(dataset, dataset_path, key_prefix)
    check_has_documents(shards, dataset_path if dataset_path is not None else dataset, f"{key_prefix}.dataset_path")


def check_has_documents(shards: list[Path], where: str, key: str) -> None:
    """The shards hold a document with text (read up to the first one: empty files or empty "text" fields would
    otherwise train on nothing but BOS/EOS tokens)."""
    for text, _ in DocumentStream(shards).read(StreamPosition()):
        if text.strip():
            return
    raise ConfigError(f"'{key}' = {quote_path(where)} holds no text ({len(shards)} file(s): empty files, blank lines "
                      "or empty \"text\" fields only)")


def count_tokens(shards: list[Path], tokenizer: TokenizerLike, limit: int) -> int:
    """Tokens of the documents as the packer reads them (BOS + text + EOS each), counted up to `limit`."""
    total = 0
    for text, _ in DocumentStream(shards).read(StreamPosition()):
        total += len(tokenizer.encode(text, bos=True, eos=True))
        if total >= limit:
            break
    return total


def check_enough_tokens(shards: list[Path], tokenizer: TokenizerLike, seq_len: int, ranks: int, where: str,
                        key: str) -> None:
    """One epoch holds a full window of seq_len + 1 tokens for every data-parallel rank; less would train each rank
    on the same few tokens repeated, epoch after epoch."""
    needed = (seq_len + 1) * ranks
    found = count_tokens(shards, tokenizer, needed)
    if found < needed:
        split = f" for each of the {ranks} data-parallel ranks ({needed} in all)" if ranks > 1 else ""
        raise ConfigError(f"'{key}' = {quote_path(where)} holds {found} tokens: fewer than one sequence of seq_len + 1 "
                          f"= {seq_len + 1} tokens{split}; add data or lower the seq_len")


# ---------------------------------------------------------------- reading documents


@dataclasses.dataclass(frozen=True)
class StreamPosition:
    """Where the next document starts: shard index, lines and bytes already read in it, global document index."""

    shard: int = 0
    line: int = 0
    byte: int = 0
    doc: int = 0


def _open_lines(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _lines_from(f: BinaryIO, path: Path, byte: int, line_no: int) -> Iterator[bytes]:
    """The lines of an open shard from `byte` on; a damaged .gz (truncated, or not gzip) is one line naming the file."""
    try:
        f.seek(byte)  # gzip seeks by decompressing forward, so it still streams
        for raw in f:
            yield raw
            line_no += 1
    except (EOFError, OSError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        what = "ends in the middle of its compressed data (a truncated download?)" if isinstance(err, EOFError) \
            else f"cannot be decompressed ({err})"
        where = f"after line {line_no:,} " if line_no else ""
        raise ConfigError(f"{path}: {where}the file {what}; download or compress it again") from None


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); .txt shards must be UTF-8") from None


def _text_of_json_line(raw: bytes, path: Path, line_no: int) -> str:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path}:{line_no}: not valid JSON; "
                          "each line must be an object with a \"text\" string") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ConfigError(f"{path}:{line_no}: no \"text\" string; each line must be an object with a \"text\" string")
    return record["text"]


class DocumentStream:
    """Streams the documents of an ordered list of shards from any position, without reading what comes before."""

    def __init__(self, shards: list[Path]):
        self.shards = shards

    def read(self, start: StreamPosition) -> Iterator[tuple[str, StreamPosition]]:
        """Yield (text, position after it) for every document from `start` on."""
        position = start
        while position.shard < len(self.shards):
            end = position
            for text, end in self._read_shard(position):
                yield text, end
            position = StreamPosition(shard=position.shard + 1, doc=end.doc)

    def _read_shard(self, start: StreamPosition) -> Iterator[tuple[str, StreamPosition]]:
        suffix = self.shards[start.shard].suffix
        if suffix == ".txt":
            return self._read_text_file(start)
        if suffix == ".parquet":
            return self._read_parquet_rows(start)
        return self._read_json_lines(start)

    def _read_text_file(self, start: StreamPosition) -> Iterator[tuple[str, StreamPosition]]:
        """A .txt file is one document; a finished file has line == 1."""
        if start.line > 0:
            return
        path = self.shards[start.shard]
        yield _read_utf8(path), StreamPosition(start.shard, 1, path.stat().st_size, start.doc + 1)

    def _read_json_lines(self, start: StreamPosition) -> Iterator[tuple[str, StreamPosition]]:
        """One document per non-blank line; a malformed line is an error naming the file and line."""
        path = self.shards[start.shard]
        line_no, byte, doc = start.line, start.byte, start.doc
        with _open_lines(path) as f:
            for raw in _lines_from(f, path, byte, line_no):
                line_no += 1
                byte += len(raw)
                if not raw.strip():
                    continue
                doc += 1
                yield _text_of_json_line(raw, path, line_no), StreamPosition(start.shard, line_no, byte, doc)

    def _read_parquet_rows(self, start: StreamPosition) -> Iterator[tuple[str, StreamPosition]]:
        """One document per row of the 'text' column; `line` counts the rows already read."""
        path = self.shards[start.shard]
        row, doc = 0, start.doc
        for text in _parquet_texts(path):
            row += 1
            if row <= start.line:
                continue
            if not isinstance(text, str):
                raise ConfigError(f"{path}: row {row} of the 'text' column is not a string")
            yield text, StreamPosition(start.shard, row, 0, doc + 1)
            doc += 1


def _parquet_texts(path: Path) -> Iterator[object]:
    """The 'text' column of a parquet file, row by row."""
    for (text,) in parquet_columns(path, ["text"]):
        yield text


def parquet_columns(path: Path, columns: list[str], keys: str | None = None) -> Iterator[tuple]:
    """Rows of some columns of a parquet file, read in batches; `keys` names the config keys that chose them."""
    try:
        import pyarrow.parquet as pq  # optional dependency: only .parquet files need it
    except ImportError:
        raise ConfigError(f"{path}: reading .parquet files needs pyarrow ({pip_install(extra='parquet')})") from None
    import pyarrow  # (the same)

    try:
        reader = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise ConfigError(f"{path}: not a readable parquet file ({err})") from None
    names = reader.schema_arrow.names
    for column in columns:
        if column not in names:
            chosen = f" ({keys})" if keys else ""
            raise ConfigError(f"{path}: no '{column}' column{chosen}; columns: {', '.join(names)}")
    rows = 0
    try:
        for batch in reader.iter_batches(columns=columns, batch_size=1024):
            values = [batch.column(i).to_pylist() for i in range(len(columns))]
            yield from zip(*values, strict=True)
            rows += batch.num_rows
    except (pyarrow.ArrowException, OSError) as err:
        raise ConfigError(f"{path}: the parquet file is damaged after row {rows:,} ({err})") from None


# ---------------------------------------------------------------- encoding, shared by threads

TASK_CHARS = 16_384  # documents are handed to an encoding thread in lists of about this many characters
TASKS_AHEAD = 4  # lists in flight per thread: enough to keep each busy, and an endless stream is never read far ahead


def encoded_documents(documents: Iterator[tuple[str, StreamPosition]], encode: Callable[[str], list[int]],
                      threads: int = 1, task_chars: int = TASK_CHARS) -> Iterator[tuple[list[int], StreamPosition]]:
    """(ids, position after the document) of every document, in document order. With threads > 1 that many threads
    encode them side by side (for encoders that release the GIL), reading ahead a bounded number of documents: the
    positions handed out are still those of the documents returned, so what is read ahead never reaches a state."""
    if threads <= 1:
        yield from ((encode(text), position) for text, position in documents)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="encode")
    pending: deque = deque()
    try:
        for task in _encoding_tasks(documents, encode, task_chars):
            pending.append(pool.submit(task))
            if len(pending) >= TASKS_AHEAD * threads:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _encoding_tasks(documents: Iterator[tuple[str, StreamPosition]], encode: Callable[[str], list[int]],
                    task_chars: int) -> Iterator[Callable[[], list]]:
    """Lists of about `task_chars` characters of documents, each a call that encodes them. An error reading the
    stream (a malformed line) becomes a last call that raises it: it reaches the reader where the stream does,
    after the documents before it."""
    batch: list[tuple[str, StreamPosition]] = []
    size = 0
    try:
        for text, position in documents:
            batch.append((text, position))
            size += len(text)
            if size >= task_chars:
                yield functools.partial(_encode_all, encode, batch)
                batch, size = [], 0
    except Exception as error:  # noqa: BLE001 - raised again, in its place in the stream
        yield functools.partial(_encode_all, encode, batch)
        yield functools.partial(_raise, error)
        return
    if batch:
        yield functools.partial(_encode_all, encode, batch)


def _encode_all(encode: Callable[[str], list[int]],
                batch: list[tuple[str, StreamPosition]]) -> list[tuple[list[int], StreamPosition]]:
    return [(encode(text), position) for text, position in batch]


def _raise(error: Exception) -> list:
    raise error


# ---------------------------------------------------------------- packing


# A training sample: (input ids, labels), or (input ids, labels, document ids) from a source that packs documents
# for block-causal attention.
Sample = tuple[torch.Tensor, ...]


def long_tensor(values: list[int]) -> torch.Tensor:
    """An int64 tensor of a list (through numpy: several times faster than torch.tensor on a Python list)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def packed_sample(tokens: list[int], documents: list[int], trained: list[bool] | None = None) -> Sample:
    """(inputs, labels, document ids) of a window of seq_len + 1 tokens and their document ids: a label is kept
    only where the next token belongs to the same document (and trains, when `trained` says which do)."""
    ids, docs = long_tensor(tokens), long_tensor(documents)
    keep = docs[1:] == docs[:-1]
    if trained is not None:
        keep &= torch.from_numpy(np.asarray(trained[1:], dtype=bool))
    return ids[:-1], torch.where(keep, ids[1:], IGNORE_INDEX), docs[:-1]


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (RoPE positions that restart at every document): documents
    [..., seq] holds the document id of every token, a document being a run of equal ids."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


class Deferred:
    """A sample read only when a rank keeps it (from a source that reads any sample by index): a data mixture's
    draws are walked by every rank, but each reads only its own samples."""

    def __init__(self, source: Any, index: int):
        self.source, self.index = source, index

    def load(self) -> Sample:
        return self.source.sample(self.index)


class SampleSource(Protocol):
    """An ordered stream of samples that can restart from any state it handed out (a dict of plain values)."""

    name: str

    def samples(self, state: dict[str, Any] | None) -> Iterator[tuple[Sample, dict[str, Any]]]: ...


class PackedSource:
    """Packs tokenized documents (bos + text + eos) into windows of seq_len + 1 tokens, in document order.

    With `documents` (block-causal attention) each window also carries every token's document id (a document cut
    by the window's start or end is a document of the window: it starts at position 0 there) and no label crosses
    from one document to the next.

    The state after a window is the epoch, the stream position after the last document read, the tokens not yet
    packed (and, with documents, the lengths of the document pieces among them), so a source restarted from it
    continues with exactly the windows that would have come next. An infinite source starts a new epoch at the end
    of the data (the leftover tokens carry over); a finite one stops (the partial last window is dropped).

    `samples(state, encoders=N)` encodes with N threads side by side (encoded_documents): the same windows and
    states, for a tokenizer that releases the GIL (`releases_gil`).
    """

    def __init__(self, name: str, stream: DocumentStream, tokenizer: TokenizerLike, seq_len: int,
                 infinite: bool = True, documents: bool = False):
        self.name = name
        self.stream = stream
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self.documents = documents

    def samples(self, state: dict[str, Any] | None = None,
                encoders: int = 1) -> Iterator[tuple[Sample, dict[str, Any]]]:
        state = self._checked(state) if state is not None else {"epoch": 0, "position": {}, "buffer": []}
        epoch, start, buffer = state["epoch"], StreamPosition(**state["position"]), list(state["buffer"])
        # the lengths of the document pieces in the buffer (a state saved without them: one piece)
        lengths = list(state.get("lengths", [len(buffer)] if buffer else []))
        window = self.seq_len + 1
        while True:
            found = False
            for ids, position in encoded_documents(self.stream.read(start), self._encode, encoders):
                found = True
                buffer.extend(ids)
                lengths += [len(ids)] if self.documents else []
                while len(buffer) >= window:
                    chunk, buffer = buffer[:window], buffer[window:]
                    if self.documents:
                        documents, lengths = _take_documents(lengths, window)
                        yield packed_sample(chunk, documents), self._state(epoch, position, buffer, lengths)
                    else:
                        tokens = long_tensor(chunk)
                        yield (tokens[:-1], tokens[1:]), self._state(epoch, position, buffer, [])
            if not found and start == StreamPosition():
                raise ConfigError(f"dataset '{self.name}' has no documents")
            if not self.infinite:
                return
            epoch, start = epoch + 1, StreamPosition()
            logger.info("Dataset %s: starting epoch %d", self.name, epoch)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, bos=True, eos=True)

    def _state(self, epoch: int, position: StreamPosition, buffer: list[int], lengths: list[int]) -> dict[str, Any]:
        state = {"epoch": epoch, "position": dataclasses.asdict(position), "buffer": list(buffer),
                 "num_shards": len(self.stream.shards)}
        return state | ({"lengths": list(lengths)} if self.documents else {})

    def _checked(self, state: dict[str, Any]) -> dict[str, Any]:
        if "num_shards" not in state:
            raise ConfigError(f"the checkpoint's data position is {saved_source(state)}, but this run reads dataset "
                              f"'{self.name}' as raw text, in order: {resume_hint(state)}")
        if state["num_shards"] != len(self.stream.shards):
            raise ConfigError(f"data position of dataset '{self.name}' was saved with {state['num_shards']} shards, "
                              f"now there are {len(self.stream.shards)}; the data changed")
        return state


def saved_source(state: dict[str, Any]) -> str:
    """What kind of source saved a data position, for the line refusing it elsewhere."""
    if "domains" in state:
        return "a data mixture's"
    if "next" in state:
        return "one read by index (token files, or shuffled rows)"
    return "another kind of source's"


def resume_hint(state: dict[str, Any]) -> str:
    if "domains" in state:
        return "enable the same 'data_mixture' to continue, or start a new run (job.dump_folder)"
    if "next" in state:
        return ("point 'training.dataset_path' at the token folder the run was started on to continue, or start a new "
                "run (job.dump_folder)")
    return "read the data as that run did, or start a new run (job.dump_folder)"


def _take_documents(lengths: list[int], window: int) -> tuple[list[int], list[int]]:
    """(the document id of each of the window's tokens, the lengths of the pieces left after it)."""
    documents, left, rest, doc = [], window, list(lengths), 0
    while left:
        take = min(left, rest[0])
        documents += [doc] * take
        doc, left, rest[0] = doc + 1, left - take, rest[0] - take
        if rest[0] == 0:
            rest.pop(0)
    return documents, rest


def build_packed_source(dataset: str, dataset_path: str | None, tokenizer: TokenizerLike, seq_len: int,
                        infinite: bool = True, key_prefix: str = "training", documents: bool = False) -> PackedSource:
    """The packed source named `dataset` (see known_datasets()); `documents`: windows carry document ids."""
    stream = DocumentStream(resolve_shards(dataset, dataset_path, key_prefix))
    return PackedSource(dataset, stream, tokenizer, seq_len, infinite, documents)
