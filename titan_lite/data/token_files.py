"""Token files: a folder of token arrays (uint16 where the vocabulary fits, else uint32; trained-token masks for chat,
instruction and preference rows), an index of document boundaries, per-record arrays and a manifest. Written once by
scripts/tokenize_data.py (token_writer.py), memory-mapped here, so any rank or worker reads any document without
reading the rest. A folder that does not check out is one line naming the file and what is wrong."""

import bisect
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from titan_lite.data.chat import load_chat_template
from titan_lite.data.tokenizer import tokenizer_fingerprint
from titan_lite.errors import ConfigError, quote_path
from titan_lite.folders import partial_folder

FORMAT = "titan_lite token files"
VERSION = 1
MANIFEST = "manifest.json"
KINDS = ("text", "chat", "instruct", "preference")
DATASET_KINDS = {"instruct": ("chat", "instruct"), "preference": ("preference",)}  # else: text
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
OFFSETS = "documents.int64"  # document d is tokens [offsets[d], offsets[d + 1]) of the whole stream
# Per record (a row of chat or instruction data, a preference pair): its row in the sources (held-out splits pick by
# it), a pair's prompt length (its first tokens in both sequences) and why a pair teaches nothing (PAIR_PROBLEMS).
RECORD_ARRAYS = {"rows": "int64", "prompt_lengths": "int32", "problems": "int8"}
PAIR_PROBLEMS = (None, "identical", "empty")
RETOKENIZE = "re-run scripts/tokenize_data.py"
PLAN = "plan.json"  # in the partial folder: what it is being written from (a resumed run must match it)


def shard_file(index: int, what: str = "tokens") -> str:
    return f"{what}-{index:05d}.bin"


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def capacity(dtype: str) -> int:
    return int(np.iinfo(DTYPES[dtype]).max) + 1


def is_token_folder(path: str | Path | None) -> bool:
    """Whether a dataset path is (or was meant to be) a token folder: it holds a manifest of ours, or token arrays."""
    if path is None or not Path(path).is_dir():
        return False
    folder = Path(path)
    if (folder / OFFSETS).exists() or (folder / shard_file(0)).exists():
        return True
    try:
        return json.loads((folder / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def template_settings(setting: str | None, folder: Path | None, tokenizer, key: str) -> dict[str, Any]:
    """The chat template as it shapes tokens: its setting and the SHA-256 of the template it names."""
    if not setting:
        return {"chat_template": None}
    source = load_chat_template(setting, folder, tokenizer, key=key).source
    return {"chat_template": setting, "chat_template_sha256": hashlib.sha256(source.encode()).hexdigest()}


def encoding_settings(kind: str, section: Any, folder: Path | None, tokenizer) -> dict[str, Any]:
    """What of [instruct] or [preference] decides the tokens of a record: the manifest keeps it, and a run whose
    settings differ is refused (packing, splits and truncation are decided when reading, and may differ)."""
    if kind == "text":
        return {}
    if kind == "preference":
        names = ("prompt_field", "chosen_field", "rejected_field")
        return {n: getattr(section, n) for n in names} | template_settings(
            section.chat_template, folder, tokenizer, "preference.chat_template")
    names = ("prompt_field", "response_field", "messages_field", "conversations_field", "template", "train_on")
    return {n: getattr(section, n) for n in names} | template_settings(
        section.chat_template, folder, tokenizer, "instruct.chat_template")


# ---------------------------------------------------------------- records as arrays


@dataclass
class Encoded:
    """One record's documents (ids and trained masks; text documents train every token) and its record values
    (RECORD_ARRAYS)."""

    documents: list[list[int]]
    masks: list[list[bool]] | None = None
    record: dict[str, int] = field(default_factory=dict)


@dataclass
class EncodedArrays:
    """Encoded records as arrays: every document's ids end to end, their masks, the documents' lengths and the record
    values."""

    ids: np.ndarray
    masks: np.ndarray | None
    lengths: np.ndarray
    records: dict[str, np.ndarray]

    @classmethod
    def of(cls, encoded: list[Encoded]) -> "EncodedArrays":
        documents = [ids for e in encoded for ids in e.documents]
        lengths = np.array([len(ids) for ids in documents], dtype=np.int64)
        count = int(lengths.sum())
        ids = np.fromiter((i for doc in documents for i in doc), dtype=np.int64, count=count)
        masks = None
        if encoded and encoded[0].masks is not None:
            masks = np.fromiter((m for e in encoded for mask in e.masks for m in mask), dtype=np.uint8, count=count)
        records = {name: np.array([e.record[name] for e in encoded], dtype=dtype)
                   for name, dtype in RECORD_ARRAYS.items() if encoded and name in encoded[0].record}
        return cls(ids, masks, lengths, records)


def table_in_memory(kind: str, encoded: list[Encoded]) -> "TokenTable":
    """Records tokenized at the start of a run, as a table in memory (in the dtype token files would keep them)."""
    arrays = EncodedArrays.of(encoded)
    offsets = np.concatenate([[0], np.cumsum(arrays.lengths)]).astype(np.int64)
    ids = arrays.ids.astype(DTYPES[dtype_for(int(arrays.ids.max(initial=0)) + 1)])
    return TokenTable(kind, offsets, [ids], None if arrays.masks is None else [arrays.masks], arrays.records)


# ---------------------------------------------------------------- reading


@dataclass
class TokenTable:
    """Documents of token ids (with their trained masks) and per-record arrays: a token folder's files, opened
    memory-mapped in each process that reads them (a pickled table carries its folder, not its arrays), or arrays
    in memory (instruction or preference rows tokenized at the start of a run)."""

    kind: str
    offsets: np.ndarray
    shards: list[np.ndarray]
    masks: list[np.ndarray] | None = None
    records: dict[str, np.ndarray] = field(default_factory=dict)
    folder: Path | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.shard_starts = [0]
        for shard in self.shards:
            self.shard_starts.append(self.shard_starts[-1] + len(shard))

    @property
    def num_tokens(self) -> int:
        return self.shard_starts[-1]

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the whole stream (over shard ends when a span crosses one)."""
        return self._span(self.shards, start, stop)

    def mask(self, start: int, stop: int) -> np.ndarray:
        """Whether tokens [start, stop) train (every token of text documents does)."""
        if self.masks is None:
            return np.ones(stop - start, dtype=bool)
        return self._span(self.masks, start, stop).astype(bool)

    def document(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens(start, stop), self.mask(start, stop)

    def _span(self, arrays: list[np.ndarray], start: int, stop: int) -> np.ndarray:
        shard = bisect.bisect_right(self.shard_starts, start) - 1
        pieces = []
        while start < stop:
            base = self.shard_starts[shard]
            take = min(stop, self.shard_starts[shard + 1]) - start
            pieces.append(arrays[shard][start - base:start - base + take])
            start, shard = start + take, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else arrays[0][:0]

    def __getstate__(self) -> dict[str, Any]:
        if self.folder is None:
            return self.__dict__
        return {"folder": self.folder, "manifest": self.manifest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "offsets" in state:
            self.__dict__.update(state)
            return
        self.__dict__.update(_mapped(state["folder"], state["manifest"]).__dict__)


def open_token_folder(path: str | Path, key: str) -> TokenTable:
    """The token folder at `path` (named by the config key `key` in errors), checked: its manifest is ours, every
    array has the size the manifest says, and the index stays within the tokens."""
    folder = Path(path)
    manifest = _read_manifest(folder, key)
    table = _mapped(folder, manifest, key)
    _check_index(table, folder, key)
    _check_ids(table, folder, key)
    return table


def largest_id(shards: list[np.ndarray]) -> int:
    """The largest token id of the arrays (-1 when they hold none)."""
    return max((int(a.max()) for a in shards if len(a)), default=-1)


def _check_ids(table: TokenTable, folder: Path, key: str) -> None:
    """Every id is inside the tokenizer's vocabulary (an embedding lookup past it fails deep inside the model): the
    largest as the manifest records it, or, for folders written before it did, as the arrays hold it."""
    vocab = (table.manifest.get("tokenizer") or {}).get("vocab_size")
    if not isinstance(vocab, int):
        return
    largest = table.manifest.get("max_id")
    if not isinstance(largest, int):
        largest = largest_id(table.shards)
    if largest >= vocab:
        raise ConfigError(f"'{key}' = {quote_path(folder)} holds token id {largest:,}, outside its tokenizer's "
                          f"vocabulary of {vocab:,} tokens (ids 0 to {vocab - 1:,}): the token files are damaged; "
                          f"{RETOKENIZE}")


def _read_manifest(folder: Path, key: str) -> dict[str, Any]:
    where = f"'{key}' = {quote_path(folder)}"
    if not folder.is_dir():
        partial = partial_folder(folder)
        hint = (f" (an interrupted scripts/tokenize_data.py run left {quote_path(partial)}: run the same command again "
                "to finish it)") if partial.is_dir() else ""
        raise ConfigError(f"{where} does not exist{hint}")
    path = folder / MANIFEST
    if not path.is_file() and (folder / PLAN).is_file():
        done = len(list(folder.glob("chunk-*.json")))
        raise ConfigError(f"{where} is the partial folder of an interrupted scripts/tokenize_data.py run ({done} "
                          "chunk(s) finished): run the same command again to finish it (it resumes from them), then "
                          "point this key at its --output_dir")
    if not path.is_file():
        raise ConfigError(f"{where} holds token arrays but no {MANIFEST}: not a complete token folder (an interrupted "
                          f"or damaged write); {RETOKENIZE} into a new folder")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{where}: {MANIFEST} is not readable JSON ({err}); {RETOKENIZE}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ConfigError(f"{where}: {MANIFEST} is not a titan_lite token manifest (format {found!r}, expected "
                          f"{FORMAT!r})")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > VERSION:
        raise ConfigError(f"{where}: token files of format version {manifest.get('version')!r}; this titan_lite reads "
                          f"version {VERSION}: update titan_lite or {RETOKENIZE}")
    if manifest.get("kind") not in KINDS or manifest.get("dtype") not in DTYPES:
        raise ConfigError(f"{where}: {MANIFEST} has kind {manifest.get('kind')!r} and dtype "
                          f"{manifest.get('dtype')!r}; expected one of {', '.join(KINDS)} and uint16 or uint32")
    vocab = (manifest.get("tokenizer") or {}).get("vocab_size", 0)
    if vocab > capacity(manifest["dtype"]):
        raise ConfigError(f"{where}: {MANIFEST} stores {manifest['dtype']} ids, but its tokenizer has {vocab:,} "
                          f"tokens (ids up to {capacity(manifest['dtype']) - 1:,} fit); {RETOKENIZE}, which picks "
                          "uint32 for such vocabularies")
    return manifest


def _array(folder: Path, name: str, dtype: str, count: int, key: str) -> np.ndarray:
    """The file as a read-only memory map of `count` values, refused in one line when its size differs."""
    path = folder / name
    itemsize = np.dtype(dtype).itemsize
    if not path.is_file():
        raise ConfigError(f"'{key}' = {quote_path(folder)}: {name} is missing; {RETOKENIZE}")
    size = path.stat().st_size
    if size != count * itemsize:
        raise ConfigError(f"'{key}' = {quote_path(folder)}: {name} holds {size // itemsize:,} values, the manifest "
                          f"says {count:,}: the token files are truncated or damaged; {RETOKENIZE}")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def _mapped(folder: Path, manifest: dict[str, Any], key: str = "dataset_path") -> TokenTable:
    dtype, kind = manifest["dtype"], manifest["kind"]
    shards = manifest.get("shards") or []
    tokens = [_array(folder, shard_file(i), dtype, s["tokens"], key) for i, s in enumerate(shards)]
    masks = None
    if kind != "text":
        masks = [_array(folder, shard_file(i, "mask"), "uint8", s["tokens"], key) for i, s in enumerate(shards)]
    records = {name: _array(folder, f"{name}.{dtype_name}", dtype_name, manifest.get("records", 0), key)
               for name, dtype_name in RECORD_ARRAYS.items() if name in manifest.get("record_arrays", [])}
    offsets = _array(folder, OFFSETS, "int64", manifest.get("documents", 0) + 1, key)
    return TokenTable(kind, offsets, tokens, masks, records, folder, manifest)


def _check_index(table: TokenTable, folder: Path, key: str) -> None:
    offsets = table.offsets
    stops_inside = len(offsets) and offsets[0] == 0 and offsets[-1] == table.num_tokens
    if not stops_inside or not bool(np.all(offsets[1:] >= offsets[:-1])):
        at = int(np.argmax(offsets > table.num_tokens)) if len(offsets) and offsets.max() > table.num_tokens else None
        what = (f"document {at - 1} ends at token {int(offsets[at]):,}, past the {table.num_tokens:,} tokens"
                if at is not None else "its document boundaries are not in order from 0 to the last token")
        raise ConfigError(f"'{key}' = {quote_path(folder)}: {OFFSETS} is damaged ({what}); {RETOKENIZE}")
    shard_ends = set(table.shard_starts)
    documents_per_shard = [s.get("documents", 0) for s in table.manifest.get("shards") or []]
    ends = np.cumsum(documents_per_shard)
    if len(ends) and not all(int(offsets[e]) in shard_ends for e in ends):
        raise ConfigError(f"'{key}' = {quote_path(folder)}: {OFFSETS} puts a document across two token arrays; "
                          f"{RETOKENIZE}")


def check_tokenizer(table: TokenTable, tokenizer, key: str) -> None:
    """The run's tokenizer is the one the files were written with."""
    if tokenizer is None:
        return
    saved, run = table.manifest.get("tokenizer") or {}, tokenizer_fingerprint(tokenizer)
    if all(saved.get(k) == run[k] for k in ("sha256", "vocab_size", "bos_id", "eos_id", "pad_id")):
        return
    raise ConfigError(f"'{key}' = {quote_path(table.folder)} was tokenized with another tokenizer ({_about(saved)}); "
                      f"this run's is {_about(run)}: {RETOKENIZE} with this run's --hf_assets_path, or use the "
                      "tokenizer it was written with")


def _about(fingerprint: dict[str, Any]) -> str:
    return (f"{fingerprint.get('file')} sha256 {str(fingerprint.get('sha256'))[:12]}, {fingerprint.get('vocab_size')} "
            f"tokens, bos {fingerprint.get('bos_id')}, eos {fingerprint.get('eos_id')}")


def check_kind(table: TokenTable, dataset: str, key: str, section: str) -> None:
    """Chat and instruction token files train dataset 'instruct', preference ones 'preference', text ones the
    pre-training datasets."""
    kinds = DATASET_KINDS.get(dataset, ("text",))
    if table.kind not in kinds:
        wanted = {"chat": "instruct", "instruct": "instruct", "preference": "preference"}.get(table.kind, "'text'")
        raise ConfigError(f"'{key}' = {quote_path(table.folder)} holds {table.kind} token files, but "
                          f"'{section}.dataset' = '{dataset}'; set it to {wanted} (or tokenize with --kind "
                          f"{'/'.join(kinds)})")


def check_settings(table: TokenTable, settings: dict[str, Any], section: str, key: str) -> None:
    """The run's [instruct] or [preference] settings that decide tokens are those the files were written with."""
    saved = table.manifest.get("settings") or {}
    for name in sorted(set(saved) | set(settings)):
        if saved.get(name) != settings.get(name):
            shown = name.removesuffix("_sha256")
            what = "a template of other text" if name.endswith("_sha256") else repr(saved.get(name))
            raise ConfigError(f"'{key}' = {quote_path(table.folder)} was tokenized with '{section}.{shown}' = {what}; "
                              f"this run has {settings.get(shown)!r}: {RETOKENIZE} with this run's settings, or set "
                              "them as the files were written")
