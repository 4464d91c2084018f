"""Document sources (bundled Shakespeare, local .txt/.jsonl/.json.gz/.parquet shards), rank sharding and token packing."""

import dataclasses
import gzip
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from torch.utils.data import IterableDataset, get_worker_info

from titan_lite.errors import ConfigError

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


def _dataset_root(dataset: str, dataset_path: str | None, key_prefix: str) -> Path:
    """The file or folder a dataset reads; a given dataset_path overrides the bundled corpus."""
    if dataset not in BUNDLED_DATASETS and dataset not in LOCAL_DATASETS:
        raise ConfigError(f"'{key_prefix}.dataset' = '{dataset}' is unknown; known datasets: {', '.join(known_datasets())}")
    if dataset_path is not None:
        return Path(dataset_path)
    if dataset in BUNDLED_DATASETS:
        return BUNDLED_DATASETS[dataset]
    raise ConfigError(
        f"dataset '{dataset}' needs '{key_prefix}.dataset_path': titan_lite reads local shards only "
        f"(no downloads); set {key_prefix}.dataset_path to a .txt/.jsonl/.json.gz/.parquet file or a folder of them"
    )


def _shards_in(root: Path, key_prefix: str) -> list[Path]:
    if not root.exists():
        raise ConfigError(f"'{key_prefix}.dataset_path' = '{root}' does not exist")
    if root.is_file():
        if not _is_shard(root):
            raise ConfigError(f"'{key_prefix}.dataset_path' = '{root}' must end in one of {', '.join(SHARD_SUFFIXES)}")
        return [root]
    shards = sorted(p for p in root.iterdir() if p.is_file() and _is_shard(p))
    if not shards:
        raise ConfigError(f"'{key_prefix}.dataset_path' = '{root}' holds no {', '.join(SHARD_SUFFIXES)} files")
    return shards


def resolve_shards(dataset: str, dataset_path: str | None, key_prefix: str = "training") -> list[Path]:
    """The shard files of a dataset, in the order their documents are read."""
    return _shards_in(_dataset_root(dataset, dataset_path, key_prefix), key_prefix)


def check_dataset(dataset: str, dataset_path: str | None, key_prefix: str = "training") -> None:
    """Config-time validation: known name, a path where one is needed, and that the path holds shards."""
    resolve_shards(dataset, dataset_path, key_prefix)


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


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); .txt shards must be UTF-8") from None


def _text_of_json_line(raw: bytes, path: Path, line_no: int) -> str:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path}:{line_no}: not valid JSON; each line must be an object with a \"text\" string") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ConfigError(f"{path}:{line_no}: no \"text\" string; each line must be an object with a \"text\" string")
    return record["text"]


class DocumentStream:
    """Streams the documents of an ordered list of shards, keeping only those of one split (rank, world)."""

    def __init__(self, shards: list[Path]):
        self.shards = shards

    def read(self, start: StreamPosition, rank: int, world: int) -> Iterator[tuple[str, StreamPosition]]:
        """Yield (text, position after it) for the documents whose global index is rank mod world."""
        position = start
        while position.shard < len(self.shards):
            for text, position in self._read_shard(position, rank, world):
                if text is not None:
                    yield text, position
            position = StreamPosition(shard=position.shard + 1, doc=position.doc)

    def _read_shard(self, start: StreamPosition, rank: int, world: int) -> Iterator[tuple[str | None, StreamPosition]]:
        """Every document of one shard from `start` on, as text for this split and None for the others."""
        suffix = self.shards[start.shard].suffix
        if suffix == ".txt":
            return self._read_text_file(start, rank, world)
        if suffix == ".parquet":
            return self._read_parquet_rows(start, rank, world)
        return self._read_json_lines(start, rank, world)

    def _read_text_file(self, start: StreamPosition, rank: int, world: int) -> Iterator[tuple[str | None, StreamPosition]]:
        """A .txt file is one document; a finished file has line == 1."""
        if start.line > 0:
            return
        path = self.shards[start.shard]
        text = _read_utf8(path) if start.doc % world == rank else None
        yield text, StreamPosition(start.shard, 1, path.stat().st_size, start.doc + 1)

    def _read_json_lines(self, start: StreamPosition, rank: int, world: int) -> Iterator[tuple[str | None, StreamPosition]]:
        """One document per non-blank line; lines of other splits are counted but not parsed."""
        path = self.shards[start.shard]
        line_no, byte, doc = start.line, start.byte, start.doc
        with _open_lines(path) as f:
            f.seek(byte)  # gzip seeks by decompressing forward, so it still streams
            for raw in f:
                line_no += 1
                byte += len(raw)
                if not raw.strip():
                    continue
                text = _text_of_json_line(raw, path, line_no) if doc % world == rank else None
                doc += 1
                yield text, StreamPosition(start.shard, line_no, byte, doc)


    def _read_parquet_rows(self, start: StreamPosition, rank: int,
                           world: int) -> Iterator[tuple[str | None, StreamPosition]]:
        """One document per row of the 'text' column; `line` counts the rows already read."""
        path = self.shards[start.shard]
        row, doc = 0, start.doc
        for text in _parquet_texts(path):
            row += 1
            if row <= start.line:
                continue
            if not isinstance(text, str):
                raise ConfigError(f"{path}: row {row} of the 'text' column is not a string")
            yield (text if doc % world == rank else None), StreamPosition(start.shard, row, 0, doc + 1)
            doc += 1


def _parquet_texts(path: Path) -> Iterator[object]:
    """The 'text' column of a parquet file, row by row, read in batches."""
    try:
        import pyarrow.parquet as pq  # optional dependency: only .parquet shards need it
    except ImportError:
        raise ConfigError(f"{path}: reading .parquet shards needs pyarrow (pip install pyarrow)") from None
    reader = pq.ParquetFile(path)
    if "text" not in reader.schema_arrow.names:
        raise ConfigError(f"{path}: no 'text' column (columns: {', '.join(reader.schema_arrow.names)})")
    for batch in reader.iter_batches(columns=["text"], batch_size=1024):
        yield from batch.column(0).to_pylist()


# ---------------------------------------------------------------- packing


def _split_of_this_worker(dp_rank: int, dp_world_size: int) -> tuple[int, int]:
    """Each DataLoader worker of a rank takes every num_workers-th of that rank's documents."""
    info = get_worker_info()
    if info is None:
        return dp_rank, dp_world_size
    return dp_rank + dp_world_size * info.id, dp_world_size * info.num_workers


class PackedDataset(IterableDataset):
    """Packs tokenized documents (bos + text + eos) into windows of seq_len + 1 tokens, with an exact resumable state.

    The state is the epoch, the position after the last document read and the tokens not yet packed,
    so a restored dataset continues with exactly the samples the original would have produced next.
    """

    def __init__(self, name: str, stream: DocumentStream, tokenizer: TokenizerLike, seq_len: int,
                 dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True):
        self.name = name
        self.stream = stream
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self._rewind(epoch=0)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _rewind(self, epoch: int) -> None:
        self._epoch = epoch
        self._position = StreamPosition()
        self._buffer: list[int] = []
        self._packed = 0  # tokens at the front of _buffer already handed out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rank, world = _split_of_this_worker(self.dp_rank, self.dp_world_size)
        while True:
            from_start = self._position == StreamPosition()
            found = False
            for text, position in self.stream.read(self._position, rank, world):
                found = True
                self._add_tokens(self.tokenizer.encode(text, bos=True, eos=True), position)
                yield from self._pack_full_windows()
            if from_start and not found:
                raise ConfigError(f"dataset '{self.name}' has no documents for data split {rank} of {world} "
                                  f"(fewer documents than data-parallel ranks x dataloader workers)")
            if not self.infinite:
                self._rewind(epoch=0)  # the partial last window is dropped; the next iter() is a fresh pass
                return
            self._rewind_for_next_epoch()

    def _rewind_for_next_epoch(self) -> None:
        leftover = self._buffer[self._packed:]
        self._epoch += 1
        self._position = StreamPosition()
        self._buffer, self._packed = leftover, 0
        logger.info("Dataset %s: starting epoch %d", self.name, self._epoch)

    def _add_tokens(self, tokens: list[int], position: StreamPosition) -> None:
        del self._buffer[:self._packed]
        self._packed = 0
        self._buffer.extend(tokens)
        self._position = position

    def _pack_full_windows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window = self.seq_len + 1
        while len(self._buffer) - self._packed >= window:
            chunk = torch.tensor(self._buffer[self._packed:self._packed + window], dtype=torch.long)
            self._packed += window  # before the yield, so state_dict() taken now already counts this sample
            yield chunk[:-1], chunk[1:]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": dataclasses.asdict(self._position),
            "buffer": self._buffer[self._packed:],
            "world": _split_of_this_worker(self.dp_rank, self.dp_world_size)[1],
            "num_shards": len(self.stream.shards),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_compatible(state)
        self._epoch = state["epoch"]
        self._position = StreamPosition(**state["position"])
        self._buffer, self._packed = list(state["buffer"]), 0

    def _check_compatible(self, state: dict[str, Any]) -> None:
        world = _split_of_this_worker(self.dp_rank, self.dp_world_size)[1]
        if state["world"] != world:
            raise ConfigError(f"dataloader checkpoint of dataset '{self.name}' was split {state['world']} ways "
                              f"(data-parallel ranks x workers), now {world}; resuming would repeat or skip data")
        if state["num_shards"] != len(self.stream.shards):
            raise ConfigError(f"dataloader checkpoint of dataset '{self.name}' was made with {state['num_shards']} "
                              f"shards, now there are {len(self.stream.shards)}; the data changed")


def build_packed_dataset(dataset: str, dataset_path: str | None, tokenizer: TokenizerLike, seq_len: int,
                         dp_rank: int, dp_world_size: int, infinite: bool = True,
                         key_prefix: str = "training") -> PackedDataset:
    """The packed, rank-split dataset named `dataset` (see known_datasets())."""
    if not 0 <= dp_rank < dp_world_size:
        raise ConfigError(f"data-parallel rank {dp_rank} is outside 0..{dp_world_size - 1}")
    if seq_len < 1:
        raise ConfigError(f"'{key_prefix}.seq_len' must be at least 1, got {seq_len}")
    stream = DocumentStream(resolve_shards(dataset, dataset_path, key_prefix))
    return PackedDataset(dataset, stream, tokenizer, seq_len, dp_rank, dp_world_size, infinite)
