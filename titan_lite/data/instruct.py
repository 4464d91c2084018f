"""Instruction data: prompt/response examples from a .jsonl, .json (array) or .parquet file, formatted with a prompt
template and tokenized with the loss on response tokens only, one example per sample or packed; and the held-out
split carved from the training file."""

import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_lite.config.schema import Instruct, JobConfig
from titan_lite.data.datasets import Sample, TokenizerLike, parquet_columns
from titan_lite.errors import ConfigError
from titan_lite.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

INSTRUCT_SUFFIXES = (".jsonl", ".json", ".parquet")
SPLITS = ("all", "train", "heldout")
# Held-out selection works in millionths of the fraction: exact integer arithmetic, the same on every machine.
_PPM = 1_000_000


@dataclass(frozen=True)
class Example:
    prompt: str
    response: str


def is_held_out(index: int, fraction: float) -> bool:
    """Whether example `index` of a file belongs to the held-out split: floor(n x fraction) of the first n examples
    are held out for every n, evenly spread (every 20th for 0.05) and independent of the file's length."""
    ppm = round(fraction * _PPM)
    return (index + 1) * ppm // _PPM > index * ppm // _PPM


def in_split(index: int, split: str, fraction: float) -> bool:
    if split == "all":
        return True
    return is_held_out(index, fraction) == (split == "heldout")


def prompt_text(template: str, prompt: str) -> str:
    """The template with its {prompt} placeholder replaced (other braces in the template are kept as they are)."""
    return template.replace("{prompt}", prompt)


class InstructionFile:
    """The examples of one file, in file order, from any example index on."""

    def __init__(self, path: Path, cfg: Instruct, key: str):
        self.path = path
        self.cfg = cfg
        self.key = key  # the config key that named the file, for error lines
        if not path.is_file():
            raise ConfigError(f"'{key}' = '{path}' is not a file (instruction data is one .jsonl, .json or .parquet "
                              "file)")
        if not path.name.endswith(INSTRUCT_SUFFIXES):
            raise ConfigError(f"'{key}' = '{path}' must end in one of {', '.join(INSTRUCT_SUFFIXES)} for "
                              "dataset 'instruct'")

    def examples(self, start: int = 0) -> Iterator[tuple[int, Example]]:
        """(index, example) for every example from index `start` on; a malformed record is one error line."""
        if self.path.suffix == ".parquet":
            records = self._parquet_records()
        elif self.path.suffix == ".json":
            records = self._json_array_records()
        else:
            records = self._json_line_records()
        for index, (where, record) in enumerate(records):
            if index >= start:
                yield index, self._example(record, where)

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

    def _parquet_records(self) -> Iterator[tuple[str, Any]]:
        fields = [self.cfg.prompt_field, self.cfg.response_field]
        for row, values in enumerate(parquet_columns(self.path, fields, "instruct.prompt_field and "
                                                                         "instruct.response_field"), start=1):
            yield f"{self.path}: row {row}", dict(zip(fields, values, strict=True))

    def _example(self, record: Any, where: str) -> Example:
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: not a JSON object; each example must be an object with the fields "
                              f"'{self.cfg.prompt_field}' and '{self.cfg.response_field}'")
        texts = []
        for key in ("prompt_field", "response_field"):
            name = getattr(self.cfg, key)
            if not isinstance(record.get(name), str):
                found = ", ".join(sorted(record)) or "none"
                raise ConfigError(f"{where}: no '{name}' string ('instruct.{key}'; fields found: {found})")
            texts.append(record[name])
        return Example(*texts)


def _parsed(raw: bytes, where: str, expected: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{where}: not valid JSON; {expected}") from None


class InstructionSource:
    """A sample stream of instruction examples (a SampleSource for the layout-independent DataLoader).

    Each example becomes bos + template(prompt) + response + eos, with labels IGNORE_INDEX wherever the next
    token is bos or prompt, so only the response and its eos carry a loss. Without packing a sample is one example
    (cut at seq_len + 1 tokens; an example whose response is cut away entirely is skipped with a warning), to be
    padded to the longest of its batch; with packing examples follow each other in windows of seq_len + 1 tokens,
    as pre-training packs documents (attention crosses example boundaries, as torchtitan's packing does).

    The state after a sample is the epoch, the index of the next example of the file and, when packing, the
    tokens not yet packed: a source restarted from it continues with exactly the samples that would have come
    next. An infinite source starts a new epoch at the end of the file; a finite one stops.
    """

    def __init__(self, name: str, file: InstructionFile, tokenizer: TokenizerLike, seq_len: int, split: str = "all",
                 infinite: bool = True):
        self.name = name
        self.file = file
        self.cfg = file.cfg
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.split = split
        self.infinite = infinite
        self._warned = False

    def examples(self, start: int = 0) -> Iterator[tuple[int, Example]]:
        """The examples of this source's split, with their index in the file."""
        for index, example in self.file.examples(start):
            if in_split(index, self.split, self.cfg.validation_fraction):
                yield index, example

    def encode(self, example: Example) -> tuple[list[int], list[bool]]:
        """(tokens, trained): bos + prompt (not trained) and response + eos (trained)."""
        prompt = self.tokenizer.encode(prompt_text(self.cfg.template, example.prompt), bos=True, eos=False)
        response = self.tokenizer.encode(example.response, bos=False, eos=True)
        return prompt + response, [False] * len(prompt) + [True] * len(response)

    def samples(self, state: dict[str, Any] | None = None) -> Iterator[tuple[Sample, dict[str, Any]]]:
        state = dict(state) if state is not None else {"epoch": 0, "index": 0, "tokens": [], "trained": []}
        epoch, start = state["epoch"], state["index"]
        tokens, trained = list(state["tokens"]), list(state["trained"])
        window = self.seq_len + 1
        while True:
            found = False
            for index, example in self.examples(start):
                found = True
                ids, mask = self.encode(example)
                if not self.cfg.packing:
                    if any(mask[1:window]):
                        yield _sample(ids[:window], mask[:window]), self._state(epoch, index + 1, [], [])
                    else:
                        self._warn_cut(index)
                    continue
                tokens, trained = tokens + ids, trained + mask
                while len(tokens) >= window:
                    sample = _sample(tokens[:window], trained[:window])
                    tokens, trained = tokens[window:], trained[window:]
                    yield sample, self._state(epoch, index + 1, tokens, trained)
            if not found and start == 0:
                raise ConfigError(f"'{self.file.key}' = '{self.file.path}' holds no examples for the {self.split} "
                                  f"split")
            if not self.infinite:
                return
            epoch, start = epoch + 1, 0
            logger.info("Dataset %s: starting epoch %d", self.name, epoch)

    def _state(self, epoch: int, index: int, tokens: list[int], trained: list[bool]) -> dict[str, Any]:
        return {"epoch": epoch, "index": index, "tokens": list(tokens), "trained": list(trained)}

    def _warn_cut(self, index: int) -> None:
        if not self._warned:
            logger.warning(f"{self.file.path}: example {index} has no response token within seq_len = {self.seq_len} "
                           "tokens and is skipped (so are further ones like it); raise training.seq_len")
            self._warned = True


def _sample(tokens: list[int], trained: list[bool]) -> Sample:
    ids = torch.tensor(tokens, dtype=torch.long)
    labels = torch.where(torch.tensor(trained[1:]), ids[1:], IGNORE_INDEX)
    return ids[:-1], labels


# ---------------------------------------------------------------- from the config


def carves_validation(cfg: JobConfig) -> bool:
    """Whether validation examples are held out of the training file (validation on instruct data with no file of
    its own)."""
    v = cfg.validation
    return v.enable and v.dataset == "instruct" and v.dataset_path is None


def instruction_file_and_split(cfg: JobConfig, section: str) -> tuple[InstructionFile, str]:
    """The file and split that [training] or [validation] reads."""
    if section == "validation" and cfg.validation.dataset_path is not None:
        return InstructionFile(Path(cfg.validation.dataset_path), cfg.instruct, "validation.dataset_path"), "all"
    if cfg.training.dataset_path is None:
        raise ConfigError("'training.dataset_path' must name a .jsonl, .json or .parquet file for dataset 'instruct'")
    file = InstructionFile(Path(cfg.training.dataset_path), cfg.instruct, "training.dataset_path")
    if section == "validation":
        return file, "heldout"
    return file, "train" if carves_validation(cfg) else "all"


def build_instruction_source(cfg: JobConfig, section: str, tokenizer: TokenizerLike,
                             infinite: bool) -> InstructionSource:
    file, split = instruction_file_and_split(cfg, section)
    return InstructionSource("instruct", file, tokenizer, getattr(cfg, section).seq_len, split, infinite)


def check_instruction_data(cfg: JobConfig, section: str) -> None:
    """Config-time: the file is there and its examples of the split read (fields, JSON) up to the first one with a
    response to train on (empty responses only would train nothing)."""
    file, split = instruction_file_and_split(cfg, section)
    found = False
    for _, example in InstructionSource("instruct", file, None, 1, split, infinite=False).examples():
        if example.response.strip():
            return
        found = True
    what = "examples with a non-empty response" if found else "examples"
    raise ConfigError(f"'{file.key}' = '{file.path}' holds no {what} for the {split} split"
                      + (" (raise 'instruct.validation_fraction')" if split == "heldout" else ""))


def count_split_examples(cfg: JobConfig, section: str, limit: int) -> int:
    """Examples of the section's split, counted up to `limit`."""
    file, split = instruction_file_and_split(cfg, section)
    source = InstructionSource("instruct", file, None, 1, split, infinite=False)
    return sum(1 for _ in itertools.islice(source.examples(), limit))
