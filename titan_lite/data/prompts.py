"""Prompts for online RL (training.dataset = "prompts"): rows with a prompt (a string, or messages ending with a user
turn) and any other fields (an answer, ...) that reward functions read, from the instruction files' formats; each
rendered as the policy sees it (the [grpo] template, or the chat template with its generation prompt); and the
stream of them a run answers, epoch after epoch (shuffled per epoch unless training.shuffle = false), with the
held-out split carved as instruction data carves it."""

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_lite.config.schema import Grpo, JobConfig
from titan_lite.data.chat import ChatEncoder, Conversation, conversation_of, openai_turns
from titan_lite.data.instruct import (
    InstructionFile,
    chat_encoder,
    in_split,
    instruction_file_and_split,
    prompt_text,
)
from titan_lite.data.order import Epochs, data_order
from titan_lite.data.preference import field_problem
from titan_lite.data.token_files import is_token_folder
from titan_lite.errors import ConfigError

logger = logging.getLogger(__name__)
Turns = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PromptRow:
    """A row's prompt (a string, or its turns) and its other fields (passed to the reward functions)."""

    prompt: str | Turns
    fields: dict[str, Any] = field(default_factory=dict, compare=False)
    where: str = field(default="", compare=False)

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)

    def question(self) -> str:
        """What the policy answers: the string, or the last (user) turn's content."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[-1][1]

    def as_reward_input(self) -> str | list[dict[str, str]]:
        """The prompt as TRL hands it to reward functions: the string, or the list of messages."""
        if isinstance(self.prompt, str):
            return self.prompt
        return [{"role": role, "content": content} for role, content in self.prompt]


@dataclass(frozen=True)
class Prompt:
    """A row as the policy answers it: its index in the file, the row, the rendered text and its token ids."""

    index: int
    row: PromptRow
    text: str
    ids: tuple[int, ...]


class PromptFile(InstructionFile):
    """The prompt rows of one file (or saved `datasets` folder), in order, read with the instruction files' readers;
    every column is kept (reward functions may read any)."""

    DATASET, WHAT, ROWS = "prompts", "prompt data", " of prompts"
    DOCUMENTS = True  # prompt + completion sequences

    def __init__(self, path: Path, cfg: Grpo, key: str):
        super().__init__(path, cfg, key)

    def _columns(self, names: list[str]) -> tuple[list[str], str]:
        return list(names), "grpo.prompt_field"

    def _record(self, record: Any, where: str) -> PromptRow:
        name = self.cfg.prompt_field
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: not a JSON object; each row must be an object with a '{name}' field "
                              "('grpo.prompt_field')")
        prompt = record.get(name)
        fields = {k: v for k, v in record.items() if k != name}
        if isinstance(prompt, str):
            row = PromptRow(prompt, fields, where)
        elif isinstance(prompt, list):
            row = PromptRow(prompt_turns(openai_turns(prompt, where, name), where, name), fields, where)
        else:
            raise ConfigError(field_problem(record, name, "grpo.prompt_field", where))
        if not row.question().strip():
            raise ConfigError(f"{where}: '{name}' is empty{' (its last user turn)' if row.conversational else ''}: "
                              "there is no problem to answer; drop the row or fill it in ('grpo.prompt_field')")
        return row


def prompt_turns(turns: list[tuple[Any, Any]], where: str, name: str) -> Turns:
    """Messages that end with the user turn the policy answers (an optional system turn first, then user and
    assistant turns alternating): checked as a conversation would be with that answer after them."""
    if turns and turns[-1][0] != "user":
        raise ConfigError(f"{where}: '{name}' must end with a user turn (the policy answers it), not "
                          f"{turns[-1][0]!r}")
    return conversation_of([*turns, ("assistant", "")], where, name).turns[:-1]


class PromptEncoder:
    """How a row becomes the text and ids the policy continues: a string prompt in the template (with bos), or the
    row's turns (a string prompt as one user turn) in the chat template with its generation prompt."""

    def __init__(self, tokenizer, chat: ChatEncoder | None, template: str = "{prompt}"):
        self.tokenizer = tokenizer
        self.chat = chat
        self.template = template

    def encode(self, row: PromptRow) -> tuple[str, list[int]]:
        if self.chat is None:
            if row.conversational:
                raise ConfigError(f"{row.where}: a prompt of messages needs a chat template: set "
                                  "'grpo.chat_template' to 'tokenizer' (the tokenizer folder's) or a template file")
            text = prompt_text(self.template, row.prompt)
            return text, self.tokenizer.encode(text, bos=True, eos=False)
        turns = (("user", row.prompt),) if isinstance(row.prompt, str) else row.prompt
        conversation = Conversation(turns, row.where)
        return self.chat.prompt_text(conversation, row.where), self.chat.prompt_ids(conversation, row.where)

    def stop_ids(self) -> tuple[int, ...]:
        """Where a completion ends: the chat template's end-of-turn token and eos, or eos."""
        if self.chat is not None:
            return self.chat.end_of_turn_ids()
        return (self.tokenizer.eos_id,) if self.tokenizer.eos_id >= 0 else ()


class PromptSource:
    """The prompts of a split (a finite pass, or epoch after epoch), rendered: in file order, or in a seeded
    permutation per epoch (training.shuffle, as the other row datasets). The split's rows are read once, when first
    needed. Its epochs and saved position are data/order.py's Epochs, as every countable source's: a source restarted
    from a position continues with exactly the prompts that would have come next, and a position saved under another
    order (the rows, training.shuffle or the seed changed) is refused in one line."""

    def __init__(self, name: str, file: PromptFile, encoder: PromptEncoder, split: str = "all",
                 infinite: bool = True, seed: int = 0, shuffle: bool = False):
        self.name = name
        self.file = file
        self.cfg: Grpo = file.cfg
        self.encoder = encoder
        self.split = split
        self.infinite = infinite
        self.epochs = Epochs(name, lambda epoch: len(self.split_rows()), seed, shuffle, fixed_size=True)
        self._rows: list[tuple[int, PromptRow]] | None = None

    def rows(self, start: int = 0) -> Iterator[tuple[int, PromptRow]]:
        """The rows of this source's split in file order, with their index in the file."""
        for index, row in self.file.examples(start):
            if in_split(index, self.split, self.cfg.validation_fraction):
                yield index, row

    def split_rows(self) -> list[tuple[int, PromptRow]]:
        """Every row of the split (read once); none is one error line."""
        if self._rows is None:
            self._rows = list(self.rows())
            if not self._rows:
                raise ConfigError(f"'{self.file.key}' = '{self.file.path}' holds no prompts for the {self.split} "
                                  "split" + (" (raise 'grpo.validation_fraction')" if self.split == "heldout" else ""))
        return self._rows

    def seek(self, state: dict[str, Any] | None) -> int:
        """The next index of a saved position (0 for None); one of another order is refused. A checkpoint of an
        earlier titan_lite saved (epoch, position) without its order: continued where it stopped, with a warning."""
        if state is not None and "next" not in state and {"epoch", "position"} <= state.keys():
            logger.warning("Dataset %s: the checkpoint's prompt position (epoch %d, position %d) was saved by an "
                           "earlier titan_lite without its order: continuing there, unchecked against this run's "
                           "seed and training.shuffle", self.name, state["epoch"], state["position"])
            return state["epoch"] * len(self.split_rows()) + state["position"]
        return self.epochs.seek(state)

    def samples(self, state: dict[str, Any] | None = None) -> Iterator[tuple[Prompt, dict[str, Any]]]:
        index = self.seek(state)
        rows = self.split_rows()
        order = self.epochs.order(len(rows))
        while self.infinite or index < len(rows):
            epoch, position, _ = self.epochs.locate(index)
            if position == 0 and epoch > 0:
                logger.info("Dataset %s: starting epoch %d", self.name, epoch)
            file_index, row = rows[order.stored(epoch, position)]
            text, ids = self.encoder.encode(row)
            index += 1
            yield Prompt(file_index, row, text, tuple(ids)), self.epochs.state_at(index)


# ---------------------------------------------------------------------------------------------- from the config


def prompt_file_and_split(cfg: JobConfig, section: str) -> tuple[PromptFile, str]:
    """The file and split that [training] or [validation] reads (rows with their text: not token files)."""
    own = section == "validation" and cfg.validation.dataset_path is not None
    key = f"{'validation' if own else 'training'}.dataset_path"
    path = cfg.validation.dataset_path if own else cfg.training.dataset_path
    if is_token_folder(path):
        raise ConfigError(f"'{key}' = '{path}' holds token files, which keep tokens but not the rows' text and "
                          "fields: GRPO renders each prompt itself and hands the other fields to the reward "
                          f"functions; point '{key}' at the rows (a .jsonl, .json or .parquet file, or a saved "
                          "datasets folder)")
    return instruction_file_and_split(cfg, section, PromptFile, cfg.grpo)


def prompt_encoder(cfg: JobConfig, tokenizer) -> PromptEncoder:
    """The run's PromptEncoder: with grpo.chat_template, the template loaded (and checked to load) now."""
    return PromptEncoder(tokenizer, chat_encoder(cfg, "grpo.chat_template", tokenizer), cfg.grpo.template)


def build_prompt_source(cfg: JobConfig, section: str, tokenizer, infinite: bool) -> PromptSource:
    file, split = prompt_file_and_split(cfg, section)
    seed, shuffle = data_order(cfg, section, countable=True, where=f"'{file.key}' = '{file.path}'")
    return PromptSource(file.DATASET, file, prompt_encoder(cfg, tokenizer), split, infinite, seed, shuffle)


def check_prompt_data(cfg: JobConfig, section: str, tokenizer=None) -> list[PromptRow]:
    """Config-time: every prompt of the split reads (fields, JSON, roles, not empty); with a tokenizer each is
    rendered and must leave room for a completion of grpo.max_completion_length tokens within seq_len (a row that
    does not is found now, not when a step reaches it). Returns the rows (the reward functions check them)."""
    file, split = prompt_file_and_split(cfg, section)
    source = PromptSource(file.DATASET, file, prompt_encoder(cfg, tokenizer), split, infinite=False)
    rows = list(source.rows())
    if not rows:
        raise ConfigError(f"'{file.key}' = '{file.path}' holds no prompts for the {split} split"
                          + (" (raise 'grpo.validation_fraction')" if split == "heldout" else ""))
    if tokenizer is None:
        conversational = next((row for _, row in rows if row.conversational), None)
        if conversational is not None and not cfg.grpo.chat_template:
            source.encoder.encode(conversational)  # its one-line error
        return [row for _, row in rows]
    seq_len = getattr(cfg, section).seq_len
    for index, row in rows:
        text, ids = source.encoder.encode(row)
        check_prompt_fits(Prompt(index, row, text, tuple(ids)), cfg.grpo.max_completion_length, seq_len, section)
    return [row for _, row in rows]


def check_prompt_fits(prompt: Prompt, max_completion_length: int, seq_len: int, section: str = "training") -> None:
    """A prompt and its longest completion fit one sequence of seq_len + 1 tokens (the training window)."""
    if len(prompt.ids) + max_completion_length > seq_len + 1:
        raise ConfigError(f"{prompt.row.where}: the prompt's {len(prompt.ids)} tokens plus "
                          f"'grpo.max_completion_length' = {max_completion_length} exceed '{section}.seq_len' = "
                          f"{seq_len} (+ 1): raise seq_len, lower max_completion_length, or shorten the prompt")
