"""Preference data: chosen/rejected pairs (TRL's standard and conversational rows, and UltraFeedback's rows whose
answers hold the whole conversation) from the instruction file formats, tokenized as two documents, prompt + chosen
and prompt + rejected (each with its own copy of the prompt), cut to fit a window by [preference]'s truncation policy,
and packed whole into windows (or one pair per sequence) whose document ids name the pair and its answer."""

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from titan_lite.config.schema import JobConfig, Preference
from titan_lite.data.chat import ChatEncoder, Conversation, conversation_of, openai_turns
from titan_lite.data.datasets import Sample, packed_sample
from titan_lite.data.indexed import RecordSource
from titan_lite.data.instruct import (
    PAD_DOCUMENT,
    InstructionFile,
    StoredRecords,
    chat_encoder,
    check_stored_rows,
    in_split,
    instruction_file_and_split,
    split_mask,
    split_words,
)
from titan_lite.data.order import data_order
from titan_lite.data.token_files import PAIR_PROBLEMS, Encoded, TokenTable, table_in_memory
from titan_lite.errors import ConfigError

logger = logging.getLogger(__name__)

CHOSEN, REJECTED = 0, 1
_WARNED: set[tuple[str, str]] = set()  # (file, problem) named in a warning in this process
Turns = tuple[tuple[str, str], ...]


def answer_document(index: int, answer: int) -> int:
    """The document id of answer CHOSEN or REJECTED of the pair in row `index` of its file: the ids of a window say
    which pair each token belongs to (id // 2) and which answer (id % 2); padding is PAD_DOCUMENT (-1)."""
    return 2 * index + answer


@dataclass(frozen=True)
class Pair:
    """A prompt and two answers: all strings (standard rows), or turns (role, content) of a conversation (the prompt
    ending before the answers' first assistant turn)."""

    prompt: str | Turns
    chosen: str | Turns
    rejected: str | Turns
    where: str = field(default="", compare=False)

    @property
    def conversational(self) -> bool:
        return not (isinstance(self.prompt, str) and isinstance(self.chosen, str))

    def problem(self) -> str | None:
        """Why the pair teaches nothing ('identical' or 'empty' answers), or None."""
        if self.chosen == self.rejected:
            return "identical"
        texts = [a if isinstance(a, str) else "".join(c for _, c in a) for a in (self.chosen, self.rejected)]
        return "empty" if not all(t.strip() for t in texts) else None

    def turns(self, answer: int) -> tuple[Turns, Turns]:
        """(prompt turns, answer turns) with string prompts as one user turn and string answers as one assistant
        turn (how a chat template sees a standard row)."""
        text = (self.chosen, self.rejected)[answer]
        prompt = (("user", self.prompt),) if isinstance(self.prompt, str) else self.prompt
        return prompt, (("assistant", text),) if isinstance(text, str) else text


# ---------------------------------------------------------------------------------------------- rows


class PreferenceFile(InstructionFile):
    """The pairs of one file (or saved `datasets` folder), in order, read with the instruction files' readers."""

    DATASET, WHAT, ROWS = "preference", "preference data", " of chosen/rejected pairs"
    DOCUMENTS = True

    def __init__(self, path: Path, cfg: Preference, key: str):
        super().__init__(path, cfg, key)

    def _columns(self, names: list[str]) -> tuple[list[str], str]:
        c = self.cfg
        prompt = [c.prompt_field] if c.prompt_field in names else []  # UltraFeedback-style rows need none
        return prompt + [c.chosen_field, c.rejected_field], "preference.chosen_field and preference.rejected_field"

    def _record(self, record: Any, where: str) -> Pair:
        c = self.cfg
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: not a JSON object; each pair must be an object with the fields "
                              f"'{c.prompt_field}', '{c.chosen_field}' and '{c.rejected_field}'")
        chosen, rejected = (self._answer(record, key, where) for key in ("chosen_field", "rejected_field"))
        if isinstance(chosen, str) != isinstance(rejected, str):
            raise ConfigError(f"{where}: '{c.chosen_field}' and '{c.rejected_field}' must both be strings or both "
                              "message lists")
        prompt = record.get(c.prompt_field)
        whole = isinstance(chosen, list) and chosen and chosen[0][0] != "assistant" and not isinstance(prompt, list)
        if whole:  # both answers hold the whole conversation, prompt included
            return _split_conversations(chosen, rejected, where, c)
        if not isinstance(prompt, (str, list)):
            raise ConfigError(field_problem(record, c.prompt_field, "preference.prompt_field", where))
        if isinstance(prompt, str) and isinstance(chosen, str):
            return Pair(prompt, chosen, rejected, where)
        prompt_turns = (("user", prompt),) if isinstance(prompt, str) else \
            tuple(openai_turns(prompt, where, c.prompt_field))
        answers = [(("assistant", a),) if isinstance(a, str) else tuple(a) for a in (chosen, rejected)]
        for key, answer in zip((c.chosen_field, c.rejected_field), answers, strict=True):
            conversation_of(list(prompt_turns + answer), where, key)
            if not answer or answer[0][0] != "assistant":
                raise ConfigError(f"{where}: '{key}' must start with an assistant turn (the answer to "
                                  f"'{c.prompt_field}')")
        return Pair(prompt_turns, *answers, where=where)

    def _answer(self, record: dict, key: str, where: str) -> str | list[tuple[Any, Any]]:
        name = getattr(self.cfg, key)
        value = record.get(name)
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return openai_turns(value, where, name)
        raise ConfigError(field_problem(record, name, f"preference.{key}", where))


def field_problem(record: dict, name: str, key: str, where: str) -> str:
    """The line for a row whose field `name` is missing, or is neither a string nor a message list."""
    if name in record:
        value = record[name]
        return (f"{where}: '{name}' is {type(value).__name__} {json.dumps(value)[:40]}, not a string or a message "
                f"list ('{key}')")
    found = ", ".join(sorted(record)) or "none"
    return f"{where}: no '{name}' string or message list ('{key}'; fields found: {found})"


def _split_conversations(chosen: list, rejected: list, where: str, c: Preference) -> Pair:
    """UltraFeedback's rows: both answers hold the whole conversation; the prompt is their common beginning, up to
    the first assistant turn where they part (TRL's extract_prompt)."""
    common = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b),
                  min(len(chosen), len(rejected)))
    starts = [i for i in range(min(common, len(chosen) - 1, len(rejected) - 1), 0, -1)
              if chosen[i][0] == rejected[i][0] == "assistant"]
    if not starts:
        raise ConfigError(f"{where}: '{c.chosen_field}' and '{c.rejected_field}' hold whole conversations but share "
                          "no prompt before an assistant turn")
    split = starts[0]
    for key, turns in ((c.chosen_field, chosen), (c.rejected_field, rejected)):
        conversation_of(turns, where, key)
    return Pair(tuple(chosen[:split]), tuple(chosen[split:]), tuple(rejected[split:]), where)


# ---------------------------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class EncodedPair:
    """The prompt's ids and each answer's (ids, whether each trains), CHOSEN first."""

    prompt: list[int]
    answers: tuple[tuple[list[int], list[bool]], tuple[list[int], list[bool]]]

    @property
    def length(self) -> int:
        """Tokens of the pair's two documents (the prompt twice)."""
        return 2 * len(self.prompt) + sum(len(ids) for ids, _ in self.answers)

    def documents(self) -> list[tuple[list[int], list[bool]]]:
        """(tokens, trained) of prompt + chosen, then prompt + rejected."""
        return [(self.prompt + ids, [False] * len(self.prompt) + mask) for ids, mask in self.answers]


class PairEncoder:
    """How pairs become tokens. Standard rows without a chat template: the prompt's ids (with bos) and each answer's
    ids (with eos) tokenized apart, as TRL does. With a chat template any row is a conversation: the prompt rendered
    with the generation prompt, each answer what the whole conversation adds to it (trained up to and including its
    end-of-turn token, as titan_lite.data.chat trains assistant turns)."""

    def __init__(self, tokenizer, chat: ChatEncoder | None, template_key: str = "preference.chat_template"):
        self.tokenizer = tokenizer
        self.chat = chat
        self.template_key = template_key

    def encode(self, pair: Pair) -> EncodedPair:
        if self.chat is None:
            if pair.conversational:
                raise ConfigError(f"{pair.where}: a conversational pair needs a chat template: set "
                                  f"'{self.template_key}' to 'tokenizer' (the tokenizer folder's) or a template file")
            prompt = self.tokenizer.encode(pair.prompt, bos=True, eos=False)
            answers = [self.tokenizer.encode(a, bos=False, eos=True) for a in (pair.chosen, pair.rejected)]
            return EncodedPair(prompt, tuple((ids, [True] * len(ids)) for ids in answers))
        rendered = []
        for answer in (CHOSEN, REJECTED):
            prompt, turns = pair.turns(answer)
            ids, trained = self.chat.encode(Conversation(prompt + turns, pair.where), pair.where)
            rendered.append((self.chat.prompt_ids(Conversation(prompt, pair.where), pair.where), ids, trained))
        # the prompt is what both renders share with the prompt alone (a template may render it differently there)
        split = min(_shared_prefix(prompt_ids, ids) for prompt_ids, ids, _ in rendered)
        answers = tuple((ids[split:], trained[split:]) for _, ids, trained in rendered)
        return EncodedPair(rendered[0][1][:split], answers)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def fit_pair(pair: EncodedPair, budget: int, mode: str, min_prompt: int, bos_id: int) -> EncodedPair | None:
    """The pair within `budget` tokens (its two documents), or None when it is dropped (truncation_mode 'drop', or
    nothing of an answer would train). The prompt is cut first (keep_end: from the left, keeping a leading bos;
    keep_start: from the right), only as far as the answers need but to no fewer than `min_prompt` tokens; then the
    answers from their end, the longer first."""
    return cut_pair(pair, budget, mode, min_prompt, bos_id)[0]


def cut_pair(pair: EncodedPair, budget: int, mode: str, min_prompt: int,
             bos_id: int) -> tuple[EncodedPair | None, str]:
    """fit_pair's pair, and why it was dropped ('' when it was not), for the warning that names it."""
    if pair.length <= budget:
        return pair, ""
    window = f"seq_len + 1 = {budget} tokens"
    if mode == "drop":
        return None, (f"its two documents (the prompt twice and both answers) hold {pair.length} tokens, more than "
                      f"{window} (truncation_mode 'drop')")
    answer_lengths = [len(ids) for ids, _ in pair.answers]
    keep = min(len(pair.prompt), max(min_prompt, (budget - sum(answer_lengths)) // 2, 1))
    prompt = pair.prompt[:keep]
    if mode == "keep_end":
        lead = pair.prompt[:1] if pair.prompt[0] == bos_id and keep > 1 else []
        prompt = lead + pair.prompt[len(pair.prompt) - (keep - len(lead)):]
    cap = _answer_cap(answer_lengths, budget - 2 * len(prompt))
    if cap < 1:
        return None, (f"its prompt, kept at {len(prompt)} tokens (max_prompt_length, or a quarter of seq_len) and "
                      f"held twice, leaves no room for its answers in {window}")
    answers = tuple((ids[:cap], mask[:cap]) for ids, mask in pair.answers)
    if not all(any(mask) for _, mask in answers):
        return None, (f"cut to fit {window} (each answer to {cap} tokens), an answer keeps none of the tokens it "
                      "trains on")
    return EncodedPair(prompt, answers), ""


def _answer_cap(lengths: list[int], room: int) -> int:
    """The largest cap with sum(min(length, cap)) <= room (water-filling: the longer answer is cut first)."""
    cap = max(lengths)
    while cap > 0 and sum(min(n, cap) for n in lengths) > room:
        cap -= 1
    return cap


# ---------------------------------------------------------------------------------------------- the source


def encoded_pair(encoder: PairEncoder, row: int, pair: Pair) -> Encoded:
    """A pair as token files keep it: its two sequences (prompt + chosen, prompt + rejected) with their trained masks,
    its row, its prompt's length, and why it teaches nothing (empty sequences then)."""
    problem = pair.problem()
    values = {"rows": row, "problems": PAIR_PROBLEMS.index(problem), "prompt_lengths": 0}
    if problem is not None:
        return Encoded([[], []], [[], []], values)
    encoded = encoder.encode(pair)
    documents = encoded.documents()
    values["prompt_lengths"] = len(encoded.prompt)
    return Encoded([ids for ids, _ in documents], [mask for _, mask in documents], values)


class PreferenceSource(RecordSource):
    """A sample stream of pairs (an IndexedSource), from a file (its pairs tokenized once, when first needed) or from
    token files: packed, each window of seq_len + 1 tokens holds whole pairs and padding after the last one that
    fits; unpacked, each sample is one pair, padded by the collate. Every sample carries the document ids of
    answer_document (so labels never cross from one answer to the next, and the objective knows each token's pair and
    answer). Shuffled (training.shuffle), each epoch places the pairs in a seeded order of its own.

    A pair with identical or empty answers teaches nothing and is skipped; one longer than a window is cut or dropped
    ([preference] truncation_mode); the first of each kind is named in a warning and the counts are logged."""

    def __init__(self, name: str, file: "PreferenceFile | StoredRecords", encoder: PairEncoder, seq_len: int,
                 split: str = "all", infinite: bool = True, report: bool = False, seed: int = 0,
                 shuffle: bool = False, warn: bool = True):
        self.file = file
        self.cfg: Preference = file.cfg
        self.encoder = encoder
        self.split = split
        self.report = report  # log the counts (the training stream; not validation's)
        self.warn = warn  # name the first pair of each kind (not the check before launch: training names it)
        self.counts: Counter = Counter()
        self._fitted: dict[int, EncodedPair] = {}  # pairs cut to fit a window
        self._wheres: dict[int, str] = {}  # file and line of each row read from a file
        super().__init__(name, seq_len, "whole" if self.cfg.packing else "one", infinite, seed, shuffle)
        self._table = file.table if isinstance(file, StoredRecords) else None

    @property
    def min_prompt(self) -> int:
        return self.cfg.max_prompt_length or self.seq_len // 4

    def pairs(self, start: int = 0) -> Iterator[tuple[int, Pair]]:
        """The pairs of this source's split, with their row index in the file."""
        for index, pair in self.file.examples(start):
            if in_split(index, self.split, self.cfg.validation_fraction):
                yield index, pair

    def table(self) -> TokenTable:
        """The split's pairs as tokens: from token files, or the file's tokenized now (once)."""
        if self._table is None:
            pairs = list(self.pairs())
            self._wheres = {index: pair.where for index, pair in pairs}  # for the warnings
            self._table = table_in_memory("preference", [encoded_pair(self.encoder, i, pair) for i, pair in pairs])
        return self._table

    def stored(self, k: int) -> EncodedPair:
        """Pair k of the table as the encoder made it."""
        table = self.table()
        prompt = int(table.records["prompt_lengths"][k])
        (chosen, chosen_mask), (rejected, rejected_mask) = table.document(2 * k), table.document(2 * k + 1)
        answers = ((chosen[prompt:].tolist(), chosen_mask[prompt:].tolist()),
                   (rejected[prompt:].tolist(), rejected_mask[prompt:].tolist()))
        return EncodedPair(chosen[:prompt].tolist(), answers)

    def fitted(self, k: int) -> EncodedPair:
        return self._fitted.get(k) or self.stored(k)

    def row(self, k: int) -> int:
        return int(self.table().records["rows"][k])

    def usable(self) -> tuple[np.ndarray, np.ndarray]:
        """The pairs that train, counting (and naming the first of) those skipped, cut or dropped."""
        table = self.table()
        rows, problems = table.records["rows"], table.records["problems"]
        in_split = split_mask(rows, self.split, self.cfg.validation_fraction)
        lengths = table.lengths()[0::2] + table.lengths()[1::2]
        self.counts = Counter(pairs=int(in_split.sum()))
        for code, problem in enumerate(PAIR_PROBLEMS[1:], start=1):
            found = np.flatnonzero(in_split & (problems == code))
            self.counts[problem] = len(found)
            if len(found):
                self._warn(problem, self.row(int(found[0])))
        ok = in_split & (problems == 0)
        budget, bos = self.window, self.encoder.tokenizer.bos_id if self.encoder.tokenizer is not None else -1
        for k in np.flatnonzero(ok & (lengths > budget)).tolist():
            fitted, why = cut_pair(self.stored(k), budget, self.cfg.truncation_mode, self.min_prompt, bos)
            problem = "too long" if fitted is None else "cut"
            self.counts[problem] += 1
            self._warn(problem, self.row(k), why)
            ok[k] = fitted is not None
            if fitted is not None:
                self._fitted[k], lengths[k] = fitted, fitted.length
        if not ok.any():
            raise ConfigError(f"'{self.file.key}' = '{self.file.path}' holds no usable pairs"
                              f"{split_words(self.split)} ({self.summary()})")
        if self.report:
            logger.info(f"preference data '{self.file.path}'{split_words(self.split)}: {self.summary()}")
        return np.flatnonzero(ok), lengths[ok]

    def encoded(self, start: int = 0) -> Iterator[tuple[int, EncodedPair]]:
        """(row index, the pair as it trains) of every usable pair from row `start` on, in file order."""
        self.prepare()
        for k in self._items.tolist():
            if self.row(k) >= start:
                yield self.row(k), self.fitted(k)

    def summary(self) -> str:
        c = self.counts
        used = c["pairs"] - c["identical"] - c["empty"] - c["too long"]
        parts = [f"{used:,} of {c['pairs']:,} pairs used"]
        what = {"cut": "cut to fit a window", "too long": f"dropped as longer than a window ({self.seq_len + 1} tokens "
                                                          "for both answers)",
                "identical": "skipped with identical answers", "empty": "skipped with an empty answer"}
        parts += [f"{c[k]:,} {text}" for k, text in what.items() if c[k]]
        return ", ".join(parts)

    def _warn(self, problem: str, row: int, why: str = "") -> None:
        """The first pair of each kind of problem in this process, named (a source read again, as the reference
        precomputation reads the training pairs, names none twice)."""
        if not self.warn or (str(self.file.path), problem) in _WARNED:
            return
        _WARNED.add((str(self.file.path), problem))
        if problem == "cut":
            action = (f"cut to fit seq_len + 1 = {self.seq_len + 1} tokens (truncation_mode "
                      f"'{self.cfg.truncation_mode}')")
        elif problem == "too long":
            action = f"dropped: {why}"
        else:
            action = f"skipped: its answers are {problem} (nothing to prefer)"
        where = self._wheres.get(row) or f"{self.file.path}: row {row}"
        logger.warning(f"{where}: pair {action}; further pairs like it are counted in the summary line")

    def one(self, item: int) -> Sample:
        pair = self.fitted(item)
        return self._sample([(self.row(item), pair)], pair.length)

    def whole(self, items: list[int]) -> Sample:
        return self._sample([(self.row(k), self.fitted(k)) for k in items], self.window)

    def _sample(self, placed: list[tuple[int, EncodedPair]], length: int) -> Sample:
        tokens, trained, documents = [], [], []
        for index, pair in placed:
            for answer, (ids, mask) in enumerate(pair.documents()):
                tokens, trained = tokens + ids, trained + mask
                documents += [answer_document(index, answer)] * len(ids)
        pad = length - len(tokens)
        tokenizer = self.encoder.tokenizer
        pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else tokenizer.eos_id
        return packed_sample(tokens + [pad_id] * pad, documents + [PAD_DOCUMENT] * pad, trained + [False] * pad)


# ---------------------------------------------------------------------------------------------- from the config


def preference_file_and_split(cfg: JobConfig, section: str) -> tuple[PreferenceFile, str]:
    """The file and split that [training] or [validation] reads."""
    return instruction_file_and_split(cfg, section, PreferenceFile, cfg.preference)


def pair_encoder(cfg: JobConfig, tokenizer) -> PairEncoder:
    """The run's PairEncoder: with preference.chat_template, the template loaded (and checked to load) now."""
    return PairEncoder(tokenizer, chat_encoder(cfg, "preference.chat_template", tokenizer))


def build_preference_source(cfg: JobConfig, section: str, tokenizer, infinite: bool) -> PreferenceSource:
    file, split = preference_file_and_split(cfg, section)
    check_stored_rows(cfg, file, tokenizer, "preference")
    seed, shuffle = data_order(cfg, section, countable=True, where=str(file.path))
    return PreferenceSource("preference", file, pair_encoder(cfg, tokenizer), getattr(cfg, section).seq_len, split,
                            infinite, report=section == "training" and infinite, seed=seed, shuffle=shuffle)


def check_preference_data(cfg: JobConfig, section: str, tokenizer=None) -> None:
    """Config-time: the file is there and its pairs of the split read (fields, JSON, roles) up to the first usable
    one; with a tokenizer that pair is also encoded (rendered with the chat template) and fitted to the window.
    Token files: written with this tokenizer and these settings, and holding a usable pair."""
    file, split = preference_file_and_split(cfg, section)
    encoder = pair_encoder(cfg, tokenizer)
    source = PreferenceSource("preference", file, encoder, getattr(cfg, section).seq_len, split, infinite=False,
                              warn=False)
    if isinstance(file, StoredRecords):
        check_stored_rows(cfg, file, tokenizer, "preference")
        source.prepare()
        return
    budget, bos = source.window, tokenizer.bos_id if tokenizer is not None else -1
    pairs = ((i, p) for i, p in source.pairs() if p.problem() is None and (
        fit_pair(encoder.encode(p), budget, cfg.preference.truncation_mode, source.min_prompt, bos) is not None
        if tokenizer is not None else _renders(p, encoder, cfg)))
    if next(pairs, None) is None:
        raise ConfigError(f"'{file.key}' = '{file.path}' holds no usable pairs{split_words(split)}"
                          + (" (raise 'preference.validation_fraction')" if split == "heldout" else ""))


def _renders(pair: Pair, encoder: PairEncoder, cfg: JobConfig) -> bool:
    """Without a tokenizer (DRY_RUN before the download): a conversational pair needs a chat template."""
    if pair.conversational and not cfg.preference.chat_template:
        encoder.encode(pair)  # its one-line error
    return True

