"""Preference data: chosen/rejected pairs (TRL's standard and conversational rows, and UltraFeedback's rows whose
answers hold the whole conversation) from the instruction file formats, tokenized as two documents, prompt + chosen
and prompt + rejected (each with its own copy of the prompt), cut to fit a window by [preference]'s truncation policy,
and packed whole into windows (or one pair per sequence) whose document ids name the pair and its answer."""

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_lite.config.schema import JobConfig, Preference
from titan_lite.data.chat import ChatEncoder, Conversation, conversation_of, openai_turns
from titan_lite.data.datasets import Sample, packed_sample
from titan_lite.data.instruct import (
    PAD_DOCUMENT,
    InstructionFile,
    chat_encoder,
    in_split,
    instruction_file_and_split,
)
from titan_lite.errors import ConfigError

logger = logging.getLogger(__name__)

CHOSEN, REJECTED = 0, 1
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
            found = ", ".join(sorted(record)) or "none"
            raise ConfigError(f"{where}: no '{c.prompt_field}' string or message list ('preference.prompt_field'; "
                              f"fields found: {found})")
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
        found = ", ".join(sorted(record)) or "none"
        raise ConfigError(f"{where}: no '{name}' string or message list ('preference.{key}'; fields found: {found})")


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
    if pair.length <= budget:
        return pair
    if mode == "drop":
        return None
    answer_lengths = [len(ids) for ids, _ in pair.answers]
    keep = min(len(pair.prompt), max(min_prompt, (budget - sum(answer_lengths)) // 2, 1))
    prompt = pair.prompt[:keep]
    if mode == "keep_end":
        lead = pair.prompt[:1] if pair.prompt[0] == bos_id and keep > 1 else []
        prompt = lead + pair.prompt[len(pair.prompt) - (keep - len(lead)):]
    cap = _answer_cap(answer_lengths, budget - 2 * len(prompt))
    answers = tuple((ids[:cap], mask[:cap]) for ids, mask in pair.answers)
    if cap < 1 or not all(any(mask) for _, mask in answers):
        return None
    return EncodedPair(prompt, answers)


def _answer_cap(lengths: list[int], room: int) -> int:
    """The largest cap with sum(min(length, cap)) <= room (water-filling: the longer answer is cut first)."""
    cap = max(lengths)
    while cap > 0 and sum(min(n, cap) for n in lengths) > room:
        cap -= 1
    return cap


# ---------------------------------------------------------------------------------------------- the source


class PreferenceSource:
    """A sample stream of pairs (a SampleSource): packed, each window of seq_len + 1 tokens holds whole pairs in file
    order and padding after the last one that fits; unpacked, each sample is one pair, padded by the collate. Every
    sample carries the document ids of answer_document (so labels never cross from one answer to the next, and the
    objective knows each token's pair and answer).

    A pair with identical or empty answers teaches nothing and is skipped; one longer than a window is cut or dropped
    ([preference] truncation_mode); the first of each kind is named in a warning and every epoch's counts are logged.
    The state after a sample is the epoch and the index of the next row: windows never span two epochs, so a pair
    appears once per window and a source restarted from a state continues with exactly the samples that would have
    come next."""

    def __init__(self, name: str, file: PreferenceFile, encoder: PairEncoder, seq_len: int, split: str = "all",
                 infinite: bool = True, report: bool = False):
        self.name = name
        self.file = file
        self.cfg: Preference = file.cfg
        self.encoder = encoder
        self.seq_len = seq_len
        self.split = split
        self.infinite = infinite
        self.report = report  # log each epoch's counts (the training stream; not validation's repeated passes)
        self.counts: Counter = Counter()
        self._warned: set[str] = set()

    @property
    def min_prompt(self) -> int:
        return self.cfg.max_prompt_length or self.seq_len // 4

    def pairs(self, start: int = 0) -> Iterator[tuple[int, Pair]]:
        """The pairs of this source's split, with their row index in the file."""
        for index, pair in self.file.examples(start):
            if in_split(index, self.split, self.cfg.validation_fraction):
                yield index, pair

    def encoded(self, start: int = 0) -> Iterator[tuple[int, EncodedPair]]:
        """(row index, the pair as it trains) of every usable pair, counting what is skipped, cut or dropped."""
        budget, bos = self.seq_len + 1, self.encoder.tokenizer.bos_id
        for index, pair in self.pairs(start):
            problem = pair.problem()
            if problem is None:
                encoded = self.encoder.encode(pair)
                fitted = fit_pair(encoded, budget, self.cfg.truncation_mode, self.min_prompt, bos)
                problem = "too long" if fitted is None else ("cut" if fitted is not encoded else None)
            self.counts["pairs"] += 1
            if problem is not None:
                self.counts[problem] += 1
                self._warn(problem, pair.where)
            if problem in (None, "cut"):
                yield index, fitted

    def samples(self, state: dict[str, Any] | None = None) -> Iterator[tuple[Sample, dict[str, Any]]]:
        state = dict(state) if state is not None else {"epoch": 0, "index": 0}
        epoch, start = state["epoch"], state["index"]
        while True:
            found = False
            self.counts.clear()
            windows = self._windows(self.encoded(start)) if self.cfg.packing else self._singles(self.encoded(start))
            for sample, next_index in windows:
                found = True
                yield sample, {"epoch": epoch, "index": next_index}
            if not found and start == 0:
                raise ConfigError(f"'{self.file.key}' = '{self.file.path}' holds no usable pairs for the {self.split} "
                                  f"split ({self.summary()})")
            if self.report and start == 0:
                logger.info(f"preference data '{self.file.path}' ({self.split} split), epoch {epoch}: {self.summary()}")
            if not self.infinite:
                return
            epoch, start = epoch + 1, 0
            logger.info("Dataset %s: starting epoch %d", self.name, epoch)

    def summary(self) -> str:
        c = self.counts
        used = c["pairs"] - c["identical"] - c["empty"] - c["too long"]
        parts = [f"{used:,} of {c['pairs']:,} pairs used"]
        what = {"cut": "cut to fit a window", "too long": f"dropped as longer than a window ({self.seq_len + 1} tokens "
                                                          "for both answers)",
                "identical": "skipped with identical answers", "empty": "skipped with an empty answer"}
        parts += [f"{c[k]:,} {text}" for k, text in what.items() if c[k]]
        return ", ".join(parts)

    def _warn(self, problem: str, where: str) -> None:
        if problem in self._warned:
            return
        self._warned.add(problem)
        if problem == "cut":
            action = (f"cut to fit seq_len + 1 = {self.seq_len + 1} tokens (truncation_mode "
                      f"'{self.cfg.truncation_mode}')")
        elif problem == "too long":
            action = f"dropped: its two answers do not fit seq_len + 1 = {self.seq_len + 1} tokens"
        else:
            action = f"skipped: its answers are {problem} (nothing to prefer)"
        logger.warning(f"{where}: pair {action}; further pairs like it are counted in each epoch's summary line")

    def _windows(self, pairs: Iterator[tuple[int, EncodedPair]]) -> Iterator[tuple[Sample, int]]:
        """(window, row index after its last pair): whole pairs in order until the next does not fit."""
        window = self.seq_len + 1
        placed: list[tuple[int, EncodedPair]] = []
        used, last = 0, None
        for index, pair in pairs:
            if placed and used + pair.length > window:
                yield self._sample(placed, window), index
                placed, used = [], 0
            placed.append((index, pair))
            used, last = used + pair.length, index
        if placed:
            yield self._sample(placed, window), last + 1

    def _singles(self, pairs: Iterator[tuple[int, EncodedPair]]) -> Iterator[tuple[Sample, int]]:
        for index, pair in pairs:
            yield self._sample([(index, pair)], pair.length), index + 1

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
    return PreferenceSource("preference", file, pair_encoder(cfg, tokenizer), getattr(cfg, section).seq_len, split,
                            infinite, report=section == "training" and infinite)


def check_preference_data(cfg: JobConfig, section: str, tokenizer=None) -> None:
    """Config-time: the file is there and its pairs of the split read (fields, JSON, roles) up to the first usable
    one; with a tokenizer that pair is also encoded (rendered with the chat template) and fitted to the window."""
    file, split = preference_file_and_split(cfg, section)
    encoder = pair_encoder(cfg, tokenizer)
    source = PreferenceSource("preference", file, encoder, getattr(cfg, section).seq_len, split, infinite=False)
    pairs = source.encoded() if tokenizer is not None else \
        ((i, p) for i, p in source.pairs() if p.problem() is None and _renders(p, encoder, cfg))
    if next(pairs, None) is None:
        raise ConfigError(f"'{file.key}' = '{file.path}' holds no usable pairs for the {split} split"
                          + (" (raise 'preference.validation_fraction')" if split == "heldout" else ""))


def _renders(pair: Pair, encoder: PairEncoder, cfg: JobConfig) -> bool:
    """Without a tokenizer (DRY_RUN before the download): a conversational pair needs a chat template."""
    if pair.conversational and not cfg.preference.chat_template:
        encoder.encode(pair)  # its one-line error
    return True

