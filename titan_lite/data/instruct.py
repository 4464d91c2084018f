"""Instruction data: prompt/response examples and conversations (OpenAI `messages`, ShareGPT `conversations`) from a
.jsonl, .json (array) or .parquet file or a Hugging Face `datasets` folder (save_to_disk), formatted with a prompt
template or the model's chat template and tokenized with the loss on what the assistant says; one example per
sample, packed back to back, or packed whole into windows with document ids (block-causal attention); and the
held-out split carved from the training file."""

import importlib
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_lite.config.schema import Instruct, JobConfig
from titan_lite.data.chat import (
    ChatEncoder,
    Conversation,
    TemplateFailure,
    conversation_of,
    load_chat_template,
    openai_thinking,
    openai_turns,
    sharegpt_turns,
)
from titan_lite.data.datasets import Sample, TokenizerLike, packed_sample, parquet_columns
from titan_lite.data.indexed import RecordSource, trained_within
from titan_lite.data.order import data_order
from titan_lite.data.token_files import (
    Encoded,
    TokenTable,
    check_kind,
    check_settings,
    check_tokenizer,
    encoding_settings,
    is_token_folder,
    open_token_folder,
    table_in_memory,
)
from titan_lite.errors import ConfigError, pip_install
from titan_lite.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

INSTRUCT_SUFFIXES = (".jsonl", ".json", ".parquet")
SAVED_DATASET = "state.json"  # what marks a folder written by datasets' save_to_disk
SPLITS = ("all", "train", "heldout")
PAD_DOCUMENT = -1  # the document id of the padding after the last whole record of a window
# Held-out selection works in millionths of the fraction: exact integer arithmetic, the same on every machine.
_PPM = 1_000_000


@dataclass(frozen=True)
class Example:
    prompt: str
    response: str
    where: str = field(default="", compare=False)  # file and row, for error lines


Record = Example | Conversation


def is_held_out(index: int, fraction: float) -> bool:
    """Whether example `index` of a file belongs to the held-out split: floor(n x fraction) of the first n examples
    are held out for every n, evenly spread (every 20th for 0.05) and independent of the file's length."""
    ppm = round(fraction * _PPM)
    return (index + 1) * ppm // _PPM > index * ppm // _PPM


def in_split(index: int, split: str, fraction: float) -> bool:
    if split == "all":
        return True
    return is_held_out(index, fraction) == (split == "heldout")


def split_words(split: str) -> str:
    """How a line names a split: '' for the whole file, else which rows."""
    return {"all": "", "train": " outside its held-out split", "heldout": " in its held-out split"}[split]


def prompt_text(template: str, prompt: str) -> str:
    """The template with its {prompt} placeholder replaced (other braces in the template are kept as they are)."""
    return template.replace("{prompt}", prompt)


class InstructionFile:
    """The records of one file (or saved `datasets` folder), in order, from any index on: a row with the messages
    field is an OpenAI conversation, one with the conversations field a ShareGPT one, any other a prompt/response
    example."""

    DATASET, WHAT, ROWS = "instruct", "instruction data", ""  # for error lines (a subclass reads preference pairs)
    DOCUMENTS = False  # whether its rows train as packed documents (block_causal unless the config says otherwise)

    def __init__(self, path: Path, cfg: Instruct, key: str):
        self.path = path
        self.cfg = cfg
        self.key = key  # the config key that named the file, for error lines
        if path.is_dir():
            if not (path / SAVED_DATASET).is_file():
                splits = sorted(p.name for p in path.iterdir() if (p / SAVED_DATASET).is_file())
                if splits:
                    raise ConfigError(f"'{key}' = '{path}' is a DatasetDict saved with datasets' save_to_disk "
                                      f"(splits: {', '.join(splits)}): name one split's folder, e.g. "
                                      f"'{path / splits[0]}'")
                raise ConfigError(f"'{key}' = '{path}' is a folder without {SAVED_DATASET}: not a dataset saved "
                                  "with datasets' save_to_disk")
            return
        if not path.is_file():
            raise ConfigError(f"'{key}' = '{path}' is not a file ({self.WHAT} is one .jsonl, .json or .parquet "
                              "file, or a folder saved with datasets' save_to_disk)")
        if not path.name.endswith(INSTRUCT_SUFFIXES):
            raise ConfigError(f"'{key}' = '{path}' must end in one of {', '.join(INSTRUCT_SUFFIXES)} for "
                              f"dataset '{self.DATASET}' (or be a folder saved with datasets' save_to_disk)")

    def examples(self, start: int = 0) -> Iterator[tuple[int, Record]]:
        """(index, record) for every record from index `start` on; a malformed one is one error line."""
        if self.path.is_dir():
            records = self._columnar_records(self._saved_dataset_rows)
        elif self.path.suffix == ".parquet":
            records = self._columnar_records(self._parquet_rows)
        elif self.path.suffix == ".json":
            records = self._json_array_records()
        else:
            records = self._json_line_records()
        for index, (where, record) in enumerate(records):
            if index >= start:
                yield index, self._record(record, where)

    def _json_line_records(self) -> Iterator[tuple[str, Any]]:
        with open(self.path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if raw.strip():
                    where = f"{self.path}:{line_no}"
                    yield where, _parsed(raw, where, "each line must be a JSON object")

    def _json_array_records(self) -> Iterator[tuple[str, Any]]:
        records = _parsed(self.path.read_bytes(), str(self.path), "a .json file must hold an array of objects")
        if not isinstance(records, list):
            raise ConfigError(f"{self.path}: not a JSON array; a .json file must hold an array of objects "
                              "(use .jsonl for one object per line)")
        for number, record in enumerate(records):
            yield f"{self.path}: element {number}", record

    def _columnar_records(self, rows) -> Iterator[tuple[str, Any]]:
        """Rows of a parquet file or saved dataset as objects of the columns one format needs: the messages
        column, else the conversations column, else the prompt and response columns."""
        for row, record in enumerate(rows(), start=1):
            yield f"{self.path}: row {row}", record

    def _columns(self, names: list[str]) -> tuple[list[str], str]:
        """(the columns to read, the config keys that name them)."""
        for key in ("messages_field", "conversations_field"):
            if getattr(self.cfg, key) in names:
                return [getattr(self.cfg, key)], f"instruct.{key}"
        return [self.cfg.prompt_field, self.cfg.response_field], "instruct.prompt_field and instruct.response_field"

    def _parquet_rows(self) -> Iterator[dict[str, Any]]:
        columns, keys = self._columns(_parquet_names(self.path))
        for values in parquet_columns(self.path, columns, keys):
            yield dict(zip(columns, values, strict=True))

    def _saved_dataset_rows(self) -> Iterator[dict[str, Any]]:
        """The rows of a `datasets` save_to_disk folder: its .arrow files (Arrow IPC streams, in state.json's
        order), read with pyarrow; no `datasets` import, no network."""
        ipc = _pyarrow_module(self.path, "ipc")
        state = _parsed((self.path / SAVED_DATASET).read_bytes(), str(self.path / SAVED_DATASET), "a JSON object")
        files = [f.get("filename") for f in state.get("_data_files", [])] if isinstance(state, dict) else []
        if not files or not all(isinstance(f, str) for f in files):
            raise ConfigError(f"{self.path / SAVED_DATASET}: no '_data_files' list; not a datasets save_to_disk folder")
        for name in files:
            with ipc.open_stream(str(self.path / name)) as reader:
                columns, keys = self._columns(reader.schema.names)
                missing = [c for c in columns if c not in reader.schema.names]
                if missing:
                    raise ConfigError(f"{self.path / name}: no '{missing[0]}' column ({keys}); columns: "
                                      f"{', '.join(reader.schema.names)}")
                for batch in reader:
                    values = [batch.column(batch.schema.get_field_index(c)).to_pylist() for c in columns]
                    for row in zip(*values, strict=True):
                        yield dict(zip(columns, row, strict=True))

    def _record(self, record: Any, where: str) -> Record:
        c = self.cfg
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: not a JSON object; each example must be an object with the fields "
                              f"'{c.messages_field}', '{c.conversations_field}' or '{c.prompt_field}' and "
                              f"'{c.response_field}'")
        if record.get(c.messages_field) is not None:
            turns = openai_turns(record[c.messages_field], where, c.messages_field)
            return conversation_of(turns, where, c.messages_field, openai_thinking(record[c.messages_field]))
        if record.get(c.conversations_field) is not None:
            turns = sharegpt_turns(record[c.conversations_field], where, c.conversations_field)
            return conversation_of(turns, where, c.conversations_field)
        texts = []
        for key in ("prompt_field", "response_field"):
            name = getattr(c, key)
            if not isinstance(record.get(name), str):
                found = ", ".join(sorted(record)) or "none"
                raise ConfigError(f"{where}: no '{name}' string ('instruct.{key}'; nor a '{c.messages_field}' or "
                                  f"'{c.conversations_field}' conversation; fields found: {found})")
            texts.append(record[name])
        return Example(*texts, where=where)


def _pyarrow_module(path: Path, name: str):
    try:
        return importlib.import_module(f"pyarrow.{name}")  # optional dependency: only these formats need it
    except ImportError:
        raise ConfigError(f"{path}: reading it needs pyarrow ({pip_install(extra='parquet')})") from None


def _parquet_names(path: Path) -> list[str]:
    return _pyarrow_module(path, "parquet").ParquetFile(path).schema_arrow.names


def _parsed(raw: bytes, where: str, expected: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{where}: not valid JSON; {expected}") from None


class InstructFormat:
    """How records become tokens: a prompt/response example with the prompt template (bos + template(prompt) +
    response + eos, the response and eos trained), or, with a chat template, any record as a conversation (a
    prompt/response example is one user and one assistant turn) rendered and trained as titan_lite.data.chat says.
    `instruct.train_on = "all"` trains every token instead."""

    def __init__(self, cfg: Instruct, tokenizer: TokenizerLike | None, chat: ChatEncoder | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.chat = chat

    def encode(self, record: Record) -> tuple[list[int], list[bool]]:
        """(tokens, whether each trains)."""
        if self.chat is not None:
            return self.chat.encode(self.conversation(record), record.where or "a record")
        if isinstance(record, Conversation):
            raise ConfigError(f"{record.where}: a conversation needs a chat template: set 'instruct.chat_template' to "
                              "'tokenizer' (the tokenizer folder's) or a template file")
        prompt = self.tokenizer.encode(prompt_text(self.cfg.template, record.prompt), bos=True, eos=False)
        response = self.tokenizer.encode(record.response, bos=False, eos=True)
        return prompt + response, [self.cfg.train_on == "all"] * len(prompt) + [True] * len(response)

    @staticmethod
    def conversation(record: Record) -> Conversation:
        if isinstance(record, Conversation):
            return record
        return Conversation((("user", record.prompt), ("assistant", record.response)), where=record.where)

    def problem(self, record: Record) -> tuple[str, list[int], str]:
        """(the prompt as text, its token ids, the reference answer) of a record to generate an answer for: the
        templated prompt, or the conversation up to its last assistant turn with the chat template's generation
        prompt."""
        if self.chat is None and isinstance(record, Example):
            text = prompt_text(self.cfg.template, record.prompt)
            return text, self.tokenizer.encode(text, bos=True, eos=False), record.response
        if self.chat is None:
            self.encode(record)  # the one-line error of a conversation without a chat template
        before, reference = self.conversation(record).problem()
        where = record.where or "a record"
        return self.chat.prompt_text(before, where), self.chat.prompt_ids(before, where), reference

    def prompt(self, text: str) -> tuple[str, list[int]]:
        """A user's prompt as the model sees it: in the prompt template, or as one user turn of a conversation."""
        return self.problem(Example(text, ""))[:2]

    def stop_ids(self) -> tuple[int, ...]:
        """What generation stops at: the chat template's end-of-turn token and eos, or eos."""
        if self.chat is not None:
            return self.chat.end_of_turn_ids()
        return (self.tokenizer.eos_id,) if self.tokenizer.eos_id >= 0 else ()


class StoredRecords:
    """Chat or instruction rows read from token files (in place of an InstructionFile): their tokens and masks, not
    their text."""

    def __init__(self, table: TokenTable, cfg: Instruct, key: str):
        self.table, self.cfg, self.key, self.path = table, cfg, key, table.folder

    def examples(self, start: int = 0) -> Iterator[tuple[int, Record]]:
        """Only answer accuracy reads a row's text from a token folder's rows (it generates from the problems)."""
        raise ConfigError(f"'validation.answer_problems' generates answers to the rows' problems, but '{self.key}' = "
                          f"'{self.path}' holds token files, which keep the rows' tokens, not their text: set "
                          "'validation.answer_problems' = 0, or point 'validation.dataset_path' at rows of held-out "
                          "problems (a .jsonl, .json or .parquet file)")


def split_mask(rows: np.ndarray, split: str, fraction: float) -> np.ndarray:
    """in_split for every row index at once."""
    if split == "all":
        return np.ones(len(rows), dtype=bool)
    ppm = round(fraction * _PPM)
    held = (rows + 1) * ppm // _PPM > rows * ppm // _PPM
    return held if split == "heldout" else ~held


def encoded_record(fmt: InstructFormat, row: int, record: Record) -> Encoded:
    """A row as token files keep it: its ids and trained mask, and its row index."""
    ids, trained = fmt.encode(record)
    return Encoded([ids], [trained], {"rows": row})


class InstructionSource(RecordSource):
    """The sample stream of instruction records (an IndexedSource for the layout-independent DataLoader), from a
    file (its records tokenized once, when first needed) or from token files.

    Each record is tokens and a trained mask (InstructFormat); labels are IGNORE_INDEX wherever the next token does
    not train. Without packing a sample is one record (cut at seq_len + 1 tokens; a record whose trained tokens are
    cut away entirely is skipped with a warning), to be padded to the longest of its batch. With packing, records
    follow each other in windows of seq_len + 1 tokens, as pre-training packs documents (attention crosses record
    boundaries, as torchtitan's packing does); with `documents` (attention block_causal) each window holds whole
    records (cut at seq_len + 1 tokens alone) and padding after the last one that fits, and carries each token's
    document id: a record sees only itself, and no label crosses from one to the next.

    Shuffled (training.shuffle), each epoch takes the records in a seeded order of its own before they are placed.
    In order, records packed across windows run over the end of an epoch into the next, as a stream does.
    """

    def __init__(self, name: str, file: "InstructionFile | StoredRecords", tokenizer: TokenizerLike, seq_len: int,
                 split: str = "all", infinite: bool = True, fmt: InstructFormat | None = None,
                 documents: bool = False, seed: int = 0, shuffle: bool = False):
        self.file = file
        self.cfg = file.cfg
        self.tokenizer = tokenizer
        self.split = split
        self.format = fmt if fmt is not None else InstructFormat(file.cfg, tokenizer)
        self.documents = documents and file.cfg.packing
        packing = "whole" if self.documents else "across" if file.cfg.packing else "one"
        super().__init__(name, seq_len, packing, infinite, seed, shuffle)
        self._table = file.table if isinstance(file, StoredRecords) else None

    def examples(self, start: int = 0) -> Iterator[tuple[int, Record]]:
        """The records of this source's split, with their index in the file."""
        for index, record in self.file.examples(start):
            if in_split(index, self.split, self.cfg.validation_fraction):
                yield index, record

    def encode(self, record: Record) -> tuple[list[int], list[bool]]:
        """(tokens, trained) of one record."""
        return self.format.encode(record)

    def table(self) -> TokenTable:
        """The split's records as tokens: from token files, or the file's tokenized now (once)."""
        if self._table is None:
            encoded = [encoded_record(self.format, index, record) for index, record in self.examples()]
            self._table = table_in_memory("instruct", encoded)
        return self._table

    def usable(self) -> tuple[np.ndarray, np.ndarray]:
        table = self.table()
        records = np.flatnonzero(split_mask(table.records["rows"], self.split, self.cfg.validation_fraction))
        lengths = table.lengths()[records]
        if self.packing != "across":
            keep = trained_within(table, records, self.window)
            if not keep.all():
                first = int(table.records["rows"][records[np.argmin(keep)]])
                logger.warning(f"{self.file.path}: example {first} has no trained token within seq_len = "
                               f"{self.seq_len} tokens and is skipped (so are further ones like it); raise "
                               "training.seq_len")
            records, lengths = records[keep], np.minimum(lengths[keep], self.window)
        if len(records) == 0:
            raise ConfigError(f"'{self.file.key}' = '{self.file.path}' holds no examples"
                              f"{split_words(self.split)}")
        return records, lengths

    def one(self, item: int) -> Sample:
        tokens, trained = self.table().document(item)
        return _sample(tokens[:self.window], trained[:self.window])

    def whole(self, items: list[int]) -> Sample:
        """Whole records and padding after them (document PAD_DOCUMENT, which trains nothing)."""
        pieces = [self.table().document(item) for item in items]
        tokens = np.concatenate([t[:self.window] for t, _ in pieces])
        trained = np.concatenate([m[:self.window] for _, m in pieces])
        documents = np.concatenate([np.full(min(len(t), self.window), doc) for doc, (t, _) in enumerate(pieces)])
        pad = self.window - len(tokens)
        pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id >= 0 else self.tokenizer.eos_id
        return packed_sample(np.concatenate([tokens.astype(np.int64), np.full(pad, pad_id)]),
                             np.concatenate([documents, np.full(pad, PAD_DOCUMENT)]),
                             np.concatenate([trained, np.zeros(pad, dtype=bool)]))

    def across(self, tokens: np.ndarray, trained: np.ndarray) -> Sample:
        return _sample(tokens, trained)


def _sample(tokens, trained) -> Sample:
    ids = torch.as_tensor(tokens, dtype=torch.long)
    labels = torch.where(torch.as_tensor(trained[1:], dtype=torch.bool), ids[1:], IGNORE_INDEX)
    return ids[:-1], labels


# ---------------------------------------------------------------- from the config


def carves_validation(cfg: JobConfig, dataset: str = "instruct") -> bool:
    """Whether validation examples are held out of the training file (validation on `dataset` with no file of its
    own)."""
    v = cfg.validation
    return v.enable and v.dataset == dataset and v.dataset_path is None


def instruction_file_and_split(cfg: JobConfig, section: str, file_class: type["InstructionFile"] | None = None,
                               settings: Any = None) -> tuple["InstructionFile", str]:
    """The file and split that [training] or [validation] reads: instruction data, or (file_class, settings) a
    reader of other rows (preference pairs) and its section."""
    file_class, settings = file_class or InstructionFile, cfg.instruct if settings is None else settings
    if section == "validation" and cfg.validation.dataset_path is not None:
        return _rows(file_class, cfg.validation.dataset_path, settings, "validation"), "all"
    if cfg.training.dataset_path is None:
        raise ConfigError("'training.dataset_path' must name a .jsonl, .json or .parquet file (or a saved datasets "
                          f"folder, or token files){file_class.ROWS} for dataset '{file_class.DATASET}'")
    file = _rows(file_class, cfg.training.dataset_path, settings, "training")
    if section == "validation":
        return file, "heldout"
    return file, "train" if carves_validation(cfg, file_class.DATASET) else "all"


def _rows(file_class: type["InstructionFile"], path: str, settings: Any, section: str) -> "InstructionFile":
    """The rows at a section's dataset_path: a file of them, or token files of them (StoredRecords)."""
    key = f"{section}.dataset_path"
    if is_token_folder(path):
        table = open_token_folder(path, key)
        check_kind(table, file_class.DATASET, key, section)
        return StoredRecords(table, settings, key)
    return file_class(Path(path), settings, key)


def check_stored_rows(cfg: JobConfig, file: Any, tokenizer, section: str) -> None:
    """Token files of rows were written with the run's tokenizer and the settings ([instruct] or [preference],
    `section`) that decide tokens."""
    if not isinstance(file, StoredRecords) or tokenizer is None:
        return
    check_tokenizer(file.table, tokenizer, file.key)
    check_settings(file.table, encoding_settings(file.table.kind, file.cfg, tokenizer_folder(cfg), tokenizer), section,
                   file.key)


def tokenizer_folder(cfg: JobConfig) -> Path | None:
    """The folder of the run's tokenizer (model.tokenizer_path, else model.hf_assets_path; a file's folder)."""
    path = cfg.model.tokenizer_path or cfg.model.hf_assets_path
    if not path:
        return None
    return Path(path) if Path(path).is_dir() else Path(path).parent


def instruct_format(cfg: JobConfig, tokenizer) -> InstructFormat:
    """The run's InstructFormat: with instruct.chat_template, the template loaded (and checked to load) now."""
    chat = chat_encoder(cfg, "instruct.chat_template", tokenizer, cfg.instruct.train_on)
    return InstructFormat(cfg.instruct, tokenizer, chat)


def chat_encoder(cfg: JobConfig, key: str, tokenizer, train_on: str = "assistant") -> ChatEncoder | None:
    """The chat template a section's `key` names ('' none: None), loaded (and checked to load) now, with the
    tokenizer (without one, DRY_RUN before the download: loaded only)."""
    section, name = key.split(".")
    setting = getattr(getattr(cfg, section), name)
    if not setting:
        return None
    template = load_chat_template(setting, tokenizer_folder(cfg), tokenizer, key=key)
    return ChatEncoder(template, tokenizer, train_on) if tokenizer is not None else None


def build_instruction_source(cfg: JobConfig, section: str, tokenizer: TokenizerLike, infinite: bool,
                             documents: bool = False) -> InstructionSource:
    file, split = instruction_file_and_split(cfg, section)
    check_stored_rows(cfg, file, tokenizer, "instruct")
    seed, shuffle = data_order(cfg, section, countable=True, where=str(file.path))
    return InstructionSource("instruct", file, tokenizer, getattr(cfg, section).seq_len, split, infinite,
                             instruct_format(cfg, tokenizer), documents, seed, shuffle)


def trains_text(record: Record, train_on: str) -> bool:
    """Whether a record has text to learn beyond its end token: a non-empty response, or a non-empty assistant turn
    among those that train (the last one only with train_on 'last_assistant'). Prompt/response examples and
    conversations follow the one rule: data without any such record is refused."""
    if isinstance(record, Example):
        return bool(record.response.strip())
    trained = record.assistant_turns()[-1:] if train_on == "last_assistant" else record.assistant_turns()
    return any(record.turns[i][1].strip() for i in trained)


def check_instruction_data(cfg: JobConfig, section: str, tokenizer=None) -> None:
    """Config-time: the file is there and its records of the split read (fields, JSON, conversation roles) up to
    the first one with something to train on (empty responses or assistant turns only would train nothing but end
    tokens); with a chat template,
    the template loads and renders those records (with the tokenizer's bos and eos, when given); a conversation
    without one is refused."""
    file, split = instruction_file_and_split(cfg, section)
    if isinstance(file, StoredRecords):
        check_stored_rows(cfg, file, tokenizer, "instruct")
        InstructionSource("instruct", file, tokenizer, getattr(cfg, section).seq_len, split, infinite=False).prepare()
        if section == "validation" and cfg.validation.answer_problems:
            next(file.examples(), None)  # answer accuracy generates from the rows' text: its one-line refusal
        return
    template = None
    if cfg.instruct.chat_template:
        template = load_chat_template(cfg.instruct.chat_template, tokenizer_folder(cfg), tokenizer)
    found = False
    for _, record in InstructionSource("instruct", file, None, 1, split, infinite=False).examples():
        if isinstance(record, Conversation) and template is None:
            InstructFormat(cfg.instruct, None).encode(record)
        if template is not None:
            messages = InstructFormat.conversation(record).messages()
            try:
                template.render(messages, add_generation_prompt=False)
            except TemplateFailure as failure:
                raise ConfigError(f"{record.where}: the chat template ({template.origin}) fails on this "
                                  f"conversation: {failure}") from None
        if trains_text(record, cfg.instruct.train_on):
            return
        found = True
    what = "examples with a non-empty response (or assistant turn)" if found else "examples"
    raise ConfigError(f"'{file.key}' = '{file.path}' holds no {what}{split_words(split)}"
                      + (" (raise 'instruct.validation_fraction')" if split == "heldout" else ""))


def count_split_examples(cfg: JobConfig, section: str, limit: int) -> int:
    """Examples of the section's split, counted up to `limit`."""
    file, split = instruction_file_and_split(cfg, section)
    source = InstructionSource("instruct", file, None, 1, split, infinite=False)
    if isinstance(file, StoredRecords):
        return min(limit, int(split_mask(file.table.records["rows"], split, cfg.instruct.validation_fraction).sum()))
    return sum(1 for _ in itertools.islice(source.examples(), limit))
