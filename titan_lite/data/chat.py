"""Conversations and chat templates: a row's conversation (OpenAI `messages`, ShareGPT `conversations`, or a
prompt/response pair), rendered with a Jinja2 chat template the way transformers renders it, tokenized, with the
tokens that train (each assistant turn's content and the end-of-turn marker the template puts after it)."""

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

from titan_lite.errors import ConfigError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# What trains: every assistant turn, the last one only, or every token of the conversation.
TRAIN_ON = ("assistant", "last_assistant", "all")
TOKENIZER_TEMPLATE = "tokenizer"  # instruct.chat_template: the tokenizer folder's own template
# A {% generation %} block's text is wrapped in these (Unicode private-use characters) while rendering, so the
# trained character spans can be read off the text and the marks removed.
_OPEN, _CLOSE = "\ue000", "\ue001"


# ---------------------------------------------------------------------------------------------- conversations


@dataclass(frozen=True)
class Conversation:
    """A checked conversation: an optional system turn, then user and assistant turns alternating, at least one
    assistant turn; an assistant turn may carry its reasoning (`thinking`, as gpt-oss's template reads it)."""

    turns: tuple[tuple[str, str], ...]  # (role, content)
    where: str = field(default="", compare=False)  # file and row, for error lines
    thinking: tuple[tuple[int, str], ...] = ()  # (assistant turn index, its reasoning text)

    def messages(self) -> list[dict[str, str]]:
        """The turns as a template sees them: [{"role": ..., "content": ...}, ...], plus "thinking" where given."""
        messages = [{"role": role, "content": content} for role, content in self.turns]
        for index, text in self.thinking:
            messages[index]["thinking"] = text
        return messages

    def assistant_turns(self) -> list[int]:
        return [i for i, (role, _) in enumerate(self.turns) if role == "assistant"]

    def problem(self) -> tuple["Conversation", str]:
        """(the turns before the last assistant turn, that turn's content): a prompt to answer and its reference."""
        last = self.assistant_turns()[-1]
        earlier = tuple((i, text) for i, text in self.thinking if i < last)
        return Conversation(self.turns[:last], self.where, earlier), self.turns[last][1]


def conversation_of(turns: list[tuple[Any, Any]], where: str, field: str,
                    thinking: tuple[tuple[int, Any], ...] = ()) -> Conversation:
    """The turns (role, content) of a row, and its assistant turns' reasoning (turn index, text), as a Conversation;
    a role out of place, a missing or non-string content or thinking, thinking on a turn that is not the
    assistant's, or no assistant turn is one ConfigError line naming `where` and the field."""
    if not turns:
        raise ConfigError(f"{where}: '{field}' holds no turns")
    checked = []
    for i, (role, content) in enumerate(turns):
        if not isinstance(content, str):
            found = "missing" if content is None else f"a {type(content).__name__}"
            raise ConfigError(f"{where}: '{field}' turn {i} ({role}) has no text content ({found}; expected a string)")
        if _OPEN in content or _CLOSE in content:
            raise ConfigError(f"{where}: '{field}' turn {i} holds the private-use character U+E000 or U+E001, "
                              "which titan_lite uses to mark generation blocks")
        expected = _expected_role(i, turns[0][0] == "system")
        if role != expected and not (expected == "user or system" and role in ("user", "system")):
            raise ConfigError(f"{where}: '{field}' turn {i} is {role!r} where {expected!r} belongs (an optional "
                              "system turn first, then user and assistant turns alternating)")
        checked.append((role, content))
    if not any(role == "assistant" for role, _ in checked):
        raise ConfigError(f"{where}: '{field}' has no assistant turn (nothing to train on)")
    for i, text in thinking:
        if checked[i][0] != "assistant" or not isinstance(text, str) or _OPEN in text or _CLOSE in text:
            raise ConfigError(f"{where}: '{field}' turn {i} ({checked[i][0]}) has a 'thinking' field; only an "
                              "assistant turn may, holding its reasoning as a string")
    return Conversation(tuple(checked), where, tuple(thinking))


def _expected_role(index: int, has_system: bool) -> str:
    if index == 0:
        return "user or system"
    return ("assistant", "user")[(index - has_system) % 2 == 0]


def openai_turns(value: Any, where: str, field: str) -> list[tuple[Any, Any]]:
    """(role, content) of an OpenAI `messages` list: [{"role": system|user|assistant, "content": str}, ...]."""
    return [(_role(m, "role", ROLES, where, field, i), m.get("content")) for i, m in enumerate(_turn_list(value, where,
                                                                                                          field))]


def openai_thinking(value: Any) -> tuple[tuple[int, Any], ...]:
    """(turn index, thinking) of the turns of an OpenAI `messages` list that carry a non-null `thinking` field (the
    assistant's reasoning, which gpt-oss's harmony template writes to the analysis channel)."""
    return tuple((i, m["thinking"]) for i, m in enumerate(value) if m.get("thinking") is not None)


def sharegpt_turns(value: Any, where: str, field: str) -> list[tuple[Any, Any]]:
    """(role, content) of a ShareGPT `conversations` list: [{"from": human|gpt|system, "value": str}, ...]."""
    return [(SHAREGPT_ROLES[_role(m, "from", SHAREGPT_ROLES, where, field, i)], m.get("value"))
            for i, m in enumerate(_turn_list(value, where, field))]


def _turn_list(value: Any, where: str, field: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ConfigError(f"{where}: '{field}' must be a list of objects (one per turn)")
    return value


def _role(message: dict, key: str, known: Iterable[str], where: str, field: str, index: int) -> str:
    role = message.get(key)
    if role not in known:
        raise ConfigError(f"{where}: '{field}' turn {index} has {key} {role!r}; expected one of {', '.join(known)}")
    return role


# ---------------------------------------------------------------------------------------------- templates


class TemplateFailure(Exception):
    """The template refused or failed to render a conversation (its message is the reason)."""


@dataclass
class ChatTemplate:
    """A Jinja2 chat template and the special-token variables it sees (bos_token, eos_token, ...), rendered as
    transformers' apply_chat_template renders it: a sandboxed environment with trimmed blocks, the loopcontrols
    extension, a tojson filter, raise_exception and strftime_now; `{% generation %}` blocks mark trained text."""

    source: str
    variables: dict[str, Any]
    origin: str  # where the template came from, for messages
    generation_stops: tuple[int, ...] = ()  # the folder's generation_config.json eos_token_id(s)

    def __post_init__(self):
        self._compiled = None

    @property
    def marks_generation(self) -> bool:
        """Whether the template wraps assistant text in {% generation %} blocks."""
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.render_spans(messages, add_generation_prompt)[0]

    def render_spans(self, messages: list[dict[str, str]],
                     add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered text, the character spans of its {% generation %} blocks)."""
        try:
            marked = self._template().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **self.variables)
        except Exception as exc:  # noqa: BLE001  (whatever a template raises is its refusal of the conversation)
            raise TemplateFailure(f"{type(exc).__name__}: {exc}") from None
        if _OPEN not in marked:
            return marked, []
        text, spans, at, opened = [], [], 0, 0
        for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
            if piece == _OPEN:
                opened = at
            elif piece == _CLOSE:
                spans.append((opened, at))
            else:
                text.append(piece)
                at += len(piece)
        return "".join(text), spans

    def _template(self):
        if self._compiled is None:
            self._compiled = _environment().from_string(self.source)
            # its globals as one dict, not jinja's ChainMap over the environment's: each render copies them into
            # its context, which from a ChainMap cost twice the rendering of a short conversation
            self._compiled.globals = dict(self._compiled.globals)
        return self._compiled


def _environment():
    """A Jinja2 environment configured as transformers configures the one it renders chat templates in."""
    import jinja2  # imported only where templates are rendered: runs without chat templates never need it
    from jinja2.ext import Extension, loopcontrols  # (the same)
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # (the same)

    class GenerationMarks(Extension):
        """{% generation %}...{% endgeneration %}: the block's text, between the two marks."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            return _OPEN + caller() + _CLOSE

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationMarks, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def special_token_variables(config: dict[str, Any]) -> dict[str, Any]:
    """The special tokens of a tokenizer_config.json by name (bos_token, eos_token, pad_token, ...), as strings."""
    variables: dict[str, Any] = {}
    for key, value in config.items():
        content = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(content, str):
            variables[key] = content
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        variables["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return variables


def load_chat_template(setting: str, tokenizer_folder: Path | None, tokenizer=None,
                       key: str = "instruct.chat_template") -> ChatTemplate:
    """instruct.chat_template (or `key`): 'tokenizer' (the folder's chat_template.jinja, else tokenizer_config.json's
    chat_template) or a template file. The special-token variables come from the folder's tokenizer_config.json,
    else from the tokenizer's own bos and eos."""
    config = _read_config(tokenizer_folder / "tokenizer_config.json") if tokenizer_folder else {}
    variables = special_token_variables(config)
    if tokenizer is not None:
        for name, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
            if name not in variables and token_id >= 0:
                variables[name] = tokenizer.decode([token_id])
    stops = generation_stop_ids(tokenizer_folder) if tokenizer_folder else ()
    if setting != TOKENIZER_TEMPLATE:
        path = Path(setting)
        if not path.is_file():
            raise ConfigError(f"'{key}' = '{setting}' is neither 'tokenizer' nor a template file")
        return ChatTemplate(_read_text(path), variables, str(path), stops)
    where = tokenizer_folder if tokenizer_folder is not None else Path("model.hf_assets_path")
    jinja_file = where / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(_read_text(jinja_file), variables, str(jinja_file), stops)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        raise ConfigError(f"'{key}' = 'tokenizer', but the tokenizer folder '{where}' has no "
                          "chat_template.jinja and its tokenizer_config.json no chat_template; name a template file")
    return ChatTemplate(source, variables, f"{where / 'tokenizer_config.json'} chat_template", stops)


def generation_stop_ids(folder: Path) -> tuple[int, ...]:
    """The eos_token_id of the folder's generation_config.json (one id or a list, as transformers' generate stops at
    each; gpt-oss lists <|return|>, <|endoftext|> and <|call|>), or none."""
    eos = _read_config(folder / "generation_config.json").get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"'{path}' is not a readable JSON file ({err})") from None
    return config if isinstance(config, dict) else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"chat template file '{path}' cannot be read ({err})") from None


# ---------------------------------------------------------------------------------------------- tokens


class ChatEncoder:
    """A chat template with a tokenizer: a conversation's token ids (the rendered text encoded as
    apply_chat_template(tokenize=True) encodes it: no added BOS or EOS, special-token text as special tokens) and
    which of them train.

    Without {% generation %} blocks the assistant turns are found by rendering the conversation up to each of them
    (with the generation prompt) and through it: the text between is the turn; it trains up to and including its
    last special token (the end-of-turn marker; text the template adds after it, like ChatML's newline, does not).
    With generation blocks their text trains, as transformers' assistant masks mark it.
    """

    _RENDERS_KEPT = 32

    def __init__(self, template: ChatTemplate, tokenizer, train_on: str = "assistant"):
        if train_on not in TRAIN_ON:
            raise ConfigError(f"'instruct.train_on' = {train_on!r}; expected one of {', '.join(TRAIN_ON)}")
        self.template = template
        self.tokenizer = tokenizer
        self.train_on = train_on
        self.specials = frozenset(tokenizer.special_ids) | {i for i in (tokenizer.bos_id, tokenizer.eos_id) if i >= 0}
        self._generation_blocks = template.marks_generation
        self._renders: dict[tuple, tuple[str, list[tuple[int, int]]]] = {}
        self._specials_as_text: list[str] | None = None

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, bos=False, eos=False, allow_special=True)

    def encode(self, conversation: Conversation, where: str) -> tuple[list[int], list[bool]]:
        """(token ids, whether each trains)."""
        text, spans = self._render(conversation.messages(), False, where)
        ids = self.ids(text)
        if self.train_on == "all":
            return ids, [True] * len(ids)
        if not self._generation_blocks:
            spans = self._turn_spans(conversation, text, where)
        elif self.train_on == "last_assistant":
            spans = spans[-1:]
        trained = [False] * len(ids)
        bounds = self._token_bounds(text, ids, [b for span in spans for b in span])
        for start, end in zip(bounds[::2], bounds[1::2], strict=True):
            if not self._generation_blocks:
                end = self._through_last_special(ids, start, end)
            trained[start:end] = [True] * (end - start)
        return ids, trained

    def prompt_ids(self, conversation: Conversation, where: str = "the prompt") -> list[int]:
        """The conversation with the template's generation prompt: what a model continues with its answer."""
        return self.ids(self._render(conversation.messages(), True, where)[0])

    def prompt_text(self, conversation: Conversation, where: str = "the prompt") -> str:
        return self._render(conversation.messages(), True, where)[0]

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The tokens generation stops at: the special token that ends an assistant turn in this template (found on
        a probe conversation), the tokenizer's eos and the folder's generation_config.json eos ids."""
        probe = Conversation((("user", "1"), ("assistant", "2")))
        stops = [self.tokenizer.eos_id] if self.tokenizer.eos_id >= 0 else []
        stops += self.template.generation_stops
        try:
            ids, trained = ChatEncoder(self.template, self.tokenizer).encode(probe, "a probe conversation")
        except ConfigError:
            return tuple(stops)
        ends = [i for i, t in zip(ids, trained, strict=True) if t and i in self.specials]
        return tuple(dict.fromkeys(ends[-1:] + stops))

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                where: str) -> tuple[str, list[tuple[int, int]]]:
        """The template's render, the last few kept: a pair's two answers render the same prompt turns."""
        key = (tuple((m["role"], m["content"], m.get("thinking")) for m in messages), add_generation_prompt)
        cache = self._renders
        if key in cache:
            return cache[key]
        try:
            rendered = self.template.render_spans(messages, add_generation_prompt)
        except TemplateFailure as failure:
            raise ConfigError(f"{where}: the chat template ({self.template.origin}) fails on this conversation: "
                              f"{failure}") from None
        if len(cache) >= self._RENDERS_KEPT:
            cache.clear()
        cache[key] = rendered
        return rendered

    def _turn_spans(self, conversation: Conversation, text: str, where: str) -> list[tuple[int, int]]:
        """The character span of each trained assistant turn, from renders of the conversation's beginnings."""
        turns = conversation.assistant_turns()
        if self.train_on == "last_assistant":
            turns = turns[-1:]
        messages = conversation.messages()
        spans = []
        for turn in turns:
            before = self._render(messages[:turn], True, where)[0]
            last = turn + 1 == len(messages)  # through the last message: the whole conversation, rendered already
            through = text if last else self._render(messages[:turn + 1], False, where)[0]
            if text.startswith(before) and text.startswith(through) and len(before) <= len(through):
                spans.append((len(before), len(through)))
                continue
            end = self._marked_turn_end(messages, turn, text) if text.startswith(before) else None
            if end is None:
                raise ConfigError(
                    f"{where}: the chat template ({self.template.origin}) renders the conversation's first {turn + 1} "
                    "turns differently from the beginning of the whole conversation, so the assistant's tokens of "
                    f"turn {turn} cannot be found; mark them with {{% generation %}} in the template or set "
                    "'instruct.train_on' = 'last_assistant'")
            spans.append((len(before), end))
        return spans

    def _marked_turn_end(self, messages: list[dict[str, str]], turn: int, text: str) -> int | None:
        """Where an earlier assistant turn ends in `text` when the template writes a turn differently once it is the
        last (gpt-oss's harmony: <|return|> and the reasoning only there, <|end|> and no reasoning before): the
        turn's content is rendered between generation marks in the whole conversation, and the turn runs through
        the first special token after it. None when the marks change the rendering or no special token follows."""
        marked = [dict(m) for m in messages]
        marked[turn]["content"] = _OPEN + marked[turn]["content"] + _CLOSE
        try:
            rendered, spans = self.template.render_spans(marked, False)
        except TemplateFailure:
            return None
        if rendered != text or len(spans) != 1:
            return None
        after = spans[0][1]
        found = [(text.find(special, after), special) for special in self._special_texts()]
        found = [(at, special) for at, special in found if at >= 0]
        if not found:
            return None
        at, special = min(found, key=lambda hit: (hit[0], -len(hit[1])))
        return at + len(special)

    def _special_texts(self) -> list[str]:
        if self._specials_as_text is None:
            self._specials_as_text = [t for t in (self.tokenizer.decode([i]) for i in sorted(self.specials)) if t]
        return self._specials_as_text

    def _token_bounds(self, text: str, ids: list[int], chars: list[int]) -> list[int]:
        """Token index of each character boundary: the pieces between boundaries encoded one by one give the same
        ids as the whole text when every boundary falls between tokens (the usual case: boundaries sit at special
        tokens). Otherwise each boundary counts the tokens the text before it shares with the whole (a token that
        straddles a boundary falls after it)."""
        pieces = [self.ids(text[a:b]) for a, b in pairwise([0, *chars, len(text)])]
        if [i for piece in pieces for i in piece] == ids:
            bounds, at = [], 0
            for piece in pieces[:-1]:
                at += len(piece)
                bounds.append(at)
            return bounds
        return [_shared_prefix(self.ids(text[:c]), ids) for c in chars]

    def _through_last_special(self, ids: list[int], start: int, end: int) -> int:
        for i in range(end - 1, start - 1, -1):
            if ids[i] in self.specials:
                return i + 1
        return end


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
