"""Reward functions: the built-ins (answer_match, format, length_penalty) and users' own as 'module.path:function'
with TRL's signature, f(prompts, completions, completion_ids, **fields) -> one float (or None) per completion, the
row's other fields passed as lists; their weighted scores of a batch of completions. A function that is missing,
lacks TRL's signature, needs a field a row lacks, raises, or returns the wrong count or a non-finite reward is one
line naming it and the row."""

import importlib
import inspect
import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from titan_lite.config.schema import Grpo
from titan_lite.data.prompts import PromptRow
from titan_lite.errors import ConfigError
from titan_lite.rl.answers import extract_answer, same_answer

logger = logging.getLogger(__name__)

# What every reward function receives besides the rows' fields (TRL's names).
STANDARD = ("prompts", "completions", "completion_ids")
BUILTIN = ("answer_match", "format", "length_penalty")


def completion_text(completion: str | list[dict[str, str]]) -> str:
    """A completion as text: the string, or the content of its one assistant message (conversational prompts)."""
    return completion if isinstance(completion, str) else completion[0]["content"]


class AnswerMatch:
    """1 when the completion's final number equals the reference's (eval's extraction and normalisation), else 0."""

    __name__ = "answer_match"

    def __init__(self, field: str):
        self.field = field
        self.needs = (field,)

    def __call__(self, completions: list, **fields) -> list[float]:
        answers = fields[self.field]
        return [float(same_answer(completion_text(c), str(a))) for c, a in zip(completions, answers, strict=True)]


class FormatMatch:
    """1 when the completion matches the pattern from its start (re.match with DOTALL and MULTILINE), else 0."""

    __name__ = "format"
    needs = ()

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern, re.DOTALL | re.MULTILINE)

    def __call__(self, completions: list, **fields) -> list[float]:
        return [1.0 if self.pattern.match(completion_text(c)) else 0.0 for c in completions]


class LengthPenalty:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then down linearly to -1 at max_length,
    -1 beyond (TRL's get_soft_overlong_punishment)."""

    __name__ = "length_penalty"
    needs = ()

    def __init__(self, max_length: int, buffer: int):
        self.max_length, self.buffer = max_length, buffer

    def __call__(self, completion_ids: list[list[int]], **fields) -> list[float]:
        free = self.max_length - self.buffer
        return [0.0 if len(ids) <= free else (free - len(ids)) / self.buffer if len(ids) <= self.max_length else -1.0
                for ids in completion_ids]


@dataclass(frozen=True)
class RewardFunction:
    """A configured reward function: its setting ('answer_match', 'pkg.mod:fn'), metric name, callable and the row
    fields it needs."""

    setting: str
    name: str
    fn: Callable[..., Sequence[Any]]
    needs: tuple[str, ...]


def builtin(name: str, cfg: Grpo) -> Callable:
    if name == "answer_match":
        return AnswerMatch(cfg.answer_field)
    if name == "format":
        return FormatMatch(cfg.format_pattern)
    return LengthPenalty(cfg.max_completion_length, cfg.length_penalty_buffer)


def load_user_function(setting: str) -> Callable:
    """'module.path:function' imported; a missing module or function is one line."""
    module_name, _, attribute = setting.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"'grpo.reward_funcs' has {setting!r}: not a built-in ({', '.join(BUILTIN)}) nor "
                          "'module.path:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"reward function '{setting}': module '{module_name}' cannot be imported ({exc}); a "
                          f"reward module is imported from the folder the run starts in ({os.getcwd()}) or from "
                          "PYTHONPATH") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ConfigError(f"reward function '{setting}': module '{module_name}' has no function '{attribute}'")
    check_signature(setting, fn)
    return fn


def check_signature(setting: str, fn: Callable) -> None:
    """A user function takes TRL's keyword arguments (by name, or through **kwargs): a function of other
    parameters is refused at launch, not reported later as a row lacking a field of that name."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    parameters = signature.parameters.values()
    by_name = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    has_kwargs = any(p.kind is p.VAR_KEYWORD for p in parameters)
    unreachable = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if unreachable or not (has_kwargs or set(STANDARD) <= by_name):
        raise ConfigError(f"reward function '{setting}' takes {signature}, but reward functions are called by "
                          "keyword as TRL calls them, f(prompts=..., completions=..., completion_ids=..., "
                          "**fields) with each row's other fields by name: give it those parameters or **kwargs")


def accepted_fields(fn: Callable) -> frozenset[str] | None:
    """The row fields a function can be passed: None (any: it takes **kwargs), else its parameters' names."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def needed_fields(fn: Callable) -> tuple[str, ...]:
    """The row fields a user function takes without a default (besides TRL's standard arguments)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in parameters if p.default is inspect.Parameter.empty and p.name not in STANDARD
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def reward_function(setting: str, cfg: Grpo) -> RewardFunction:
    if setting in BUILTIN:
        fn = builtin(setting, cfg)
        return RewardFunction(setting, setting, fn, fn.needs)
    fn = load_user_function(setting)
    return RewardFunction(setting, getattr(fn, "__name__", setting.partition(":")[2]), fn, needed_fields(fn))


class Rewards:
    """The run's reward functions and weights: their scores of a batch of completions, [completions, functions]
    float32 (NaN where a function returned None), and the weighted sum."""

    def __init__(self, cfg: Grpo):
        self.functions = [reward_function(setting, cfg) for setting in cfg.reward_funcs]
        self.weights = torch.tensor(cfg.reward_weights or [1.0] * len(self.functions), dtype=torch.float32)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    def check_fields(self, rows: Sequence[PromptRow]) -> None:
        """Every row holds the fields every function needs, and none a function cannot be passed: one line naming
        the function, the field and the row."""
        for f in self.functions:
            accepted = accepted_fields(f.fn) if f.setting not in BUILTIN else None
            for row in rows:
                missing = [name for name in f.needs if name not in row.fields]
                if missing:
                    found = ", ".join(sorted(row.fields)) or "none besides the prompt"
                    hint = " ('grpo.answer_field')" if f.setting == "answer_match" else ""
                    raise ConfigError(f"{row.where}: reward function '{f.setting}' needs the field '{missing[0]}'"
                                      f"{hint}, which this row lacks (fields: {found})")
                extra = sorted(name for name in row.fields if name not in STANDARD) if accepted is not None else []
                extra = [name for name in extra if name not in accepted]
                if extra:
                    raise ConfigError(f"{row.where}: reward function '{f.setting}' is passed this row's field "
                                      f"'{extra[0]}' by name (as TRL passes every field), but has no such parameter "
                                      "and no **kwargs: add **kwargs to it")

    def check_rows(self, rows: Sequence[PromptRow]) -> None:
        """Launch-time, every row of the data: the fields (check_fields), and answers answer_match can read."""
        self.check_fields(rows)
        for f in self.functions:
            if isinstance(f.fn, AnswerMatch):
                check_answers(rows, f.fn.field)

    def score(self, rows: Sequence[PromptRow], completions: Sequence[str], completion_ids: Sequence[list[int]]
              ) -> torch.Tensor:
        """[completions, functions] scores; rows[i] is the row completion i answers."""
        self.check_fields(rows)
        columns = [self.call(f, rows, completions, completion_ids) for f in self.functions]
        return torch.tensor(columns, dtype=torch.float32).T.reshape(len(completions), len(self.functions))

    def total(self, scores: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each completion's scores (None counted as 0; NaN where every function gave None)."""
        total = (scores * self.weights).nansum(dim=1)
        return total.masked_fill(scores.isnan().all(dim=1), float("nan"))

    def call(self, f: RewardFunction, rows: Sequence[PromptRow], completions: Sequence[str],
             completion_ids: Sequence[list[int]]) -> list[float]:
        try:
            values = f.fn(**reward_arguments(rows, completions, completion_ids))
        except Exception as exc:  # noqa: BLE001 - a user's function: any failure is one line, with the row it hit
            raise ConfigError(self.failure(f, rows, completions, completion_ids, exc)) from None
        values = list(values) if isinstance(values, (list, tuple)) or hasattr(values, "tolist") else values
        if not isinstance(values, list) or len(values) != len(completions):
            count = len(values) if isinstance(values, list) else type(values).__name__
            raise ConfigError(f"reward function '{f.setting}' returned {count} values for {len(completions)} "
                              f"completions (rows {rows[0].where} to {rows[-1].where}); it must return one float (or "
                              "None) per completion")
        return [as_reward(v, f, row) for v, row in zip(values, rows, strict=True)]

    def failure(self, f: RewardFunction, rows, completions, completion_ids, exc: Exception) -> str:
        """The line of a function that raised: the first row it raises on alone (else the batch's first row)."""
        where = rows[0].where
        for i, row in enumerate(rows):
            try:
                f.fn(**reward_arguments([row], completions[i:i + 1], completion_ids[i:i + 1]))
            except Exception as alone:  # noqa: BLE001 - looking for the row that fails
                where, exc = row.where, alone
                break
        return f"reward function '{f.setting}' raised {type(exc).__name__}: {exc} (on the completion of {where})"


def check_answers(rows: Sequence[PromptRow], field: str) -> None:
    """answer_match compares final numbers: rows whose reference holds none score 0 whatever the policy answers.
    None of them readable is one line; some are a warning with their count and the first."""
    unreadable = [row for row in rows if extract_answer(str(row.fields[field])) is None]
    if not unreadable:
        return
    first = unreadable[0]
    shown = json.dumps(first.fields[field])[:40]
    if len(unreadable) == len(rows):
        raise ConfigError(f"{first.where}: reward function 'answer_match' finds no number in the row's '{field}' "
                          f"({shown}), nor in any other row's: every reward would be 0; point 'grpo.answer_field' at "
                          "the field holding the answer (e.g. '#### 72') or use another reward function")
    logger.warning(f"{len(unreadable)} of {len(rows)} rows' '{field}' hold no number answer_match can read (the "
                   f"first: {first.where}, {shown}): their completions score 0 whatever they answer")


def as_reward(value: Any, f: RewardFunction, row: PromptRow) -> float:
    if value is None:
        return math.nan
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"reward function '{f.setting}' returned {value!r} for the completion of {row.where}; "
                          "expected a float or None") from None
    if not math.isfinite(reward):
        raise ConfigError(f"reward function '{f.setting}' returned {reward} for the completion of {row.where}: a "
                          "reward must be finite (return None for a missing score)")
    return reward


def reward_arguments(rows: Sequence[PromptRow], completions: Sequence[str],
                     completion_ids: Sequence[list[int]]) -> dict[str, list]:
    """TRL's keyword arguments: prompts, completions (strings, or one assistant message each for conversational
    prompts), completion_ids, and each field of the rows as a list."""
    names = dict.fromkeys(name for row in rows for name in row.fields)
    return {"prompts": [row.as_reward_input() for row in rows],
            "completions": [[{"role": "assistant", "content": text}] if row.conversational else text
                            for row, text in zip(rows, completions, strict=True)],
            "completion_ids": [list(ids) for ids in completion_ids],
            **{name: [row.fields.get(name) for row in rows] for name in names if name not in STANDARD}}
