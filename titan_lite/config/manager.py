"""Turns a TOML file plus `--section.key value` overrides into a typed JobConfig (CLI > TOML > defaults)."""

import dataclasses
import difflib
import functools
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError, quote_path

# ---------------------------------------------------------------- schema introspection


def _is_section(f: dataclasses.Field) -> bool:
    return dataclasses.is_dataclass(f.default_factory) if f.default_factory is not dataclasses.MISSING else False


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_options(cls: type = JobConfig, prefix: str = ""):
    """Yield (dotted_key, field, type) for every leaf option of the schema."""
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if _is_section(f):
            yield from iter_options(f.default_factory, key + ".")
        else:
            yield key, f, hints[f.name]


def iter_sections(cls: type = JobConfig, prefix: str = ""):
    """Yield (dotted_key, field, section class) for every section and sub-section of the schema."""
    for f in dataclasses.fields(cls):
        if _is_section(f):
            yield f"{prefix}{f.name}", f, f.default_factory
            yield from iter_sections(f.default_factory, f"{prefix}{f.name}.")


def all_keys() -> list[str]:
    return [k for k, _, _ in iter_options()]


def _closest(key: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


# ---------------------------------------------------------------- value conversion


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def choices_of(tp: Any) -> tuple | None:
    """The allowed values of a `Literal[...]` (or optional Literal) field type; None for other types."""
    base, _ = _unwrap_optional(tp)
    return typing.get_args(base) if typing.get_origin(base) is typing.Literal else None


def not_one_of(key: str, value: Any, choices: tuple) -> str:
    """The one-line error for a value outside a Literal field's choices (a value the field declares `refused`: why)."""
    refused = _refused_values().get(key, {})
    if isinstance(value, str) and value in refused:
        return f"'{key}' = {value!r} is not supported: {refused[value]}"
    return f"'{key}' = {value!r} is not one of: {', '.join(map(str, choices))}"


@functools.cache
def _refused_values() -> dict[str, dict[str, str]]:
    return {key: f.metadata["refused"] for key, f, _ in iter_options() if f.metadata.get("refused")}


def _type_name(tp: Any) -> str:
    base, optional = _unwrap_optional(tp)
    choices = choices_of(tp)
    if choices:
        name, optional = " | ".join(map(str, choices)), optional and "none" not in choices
    elif typing.get_origin(base) is list:
        name = "a list of numbers" if _item_type(base) is float else "a list of strings"
    else:
        name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[base]
    return name + (" (or none)" if optional else "")


def _from_string(key: str, text: str, tp: Any) -> Any:
    """Convert a command-line string to the field's type (a Literal value wins over none: it survives to_toml)."""
    base, optional = _unwrap_optional(tp)
    choices = choices_of(tp) or ()
    match = [c for c in choices if str(c) == text]
    if match:
        return match[0]
    if optional and text.lower() in ("none", "null"):
        return None
    if choices:
        raise ConfigError(not_one_of(key, text, choices))
    if typing.get_origin(base) is list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        return _numbers(key, items, tp) if _item_type(base) is float else items
    if base is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--{key}: expected true or false, got '{text}'")
    try:
        return base(text)
    except ValueError:
        raise ConfigError(f"--{key}: expected {_type_name(tp)}, got '{text}'") from None


def _item_type(list_type: Any) -> Any:
    args = typing.get_args(list_type)
    return args[0] if args else str


def _numbers(key: str, items: list[str], tp: Any) -> list[float]:
    try:
        return [float(item) for item in items]
    except ValueError:
        raise ConfigError(f"--{key}: expected {_type_name(tp)}, got '{','.join(items)}'") from None


def _check_toml_value(key: str, value: Any, tp: Any, source: str) -> Any:
    """Check a TOML value against the field's type; ints are accepted where floats are expected."""
    base, optional = _unwrap_optional(tp)
    if value is None and optional:
        return None
    choices = choices_of(tp)
    if choices:
        if not any(type(c) is type(value) and c == value for c in choices):
            raise ConfigError(f"{source}: {not_one_of(key, value, choices)}")
        return value
    if typing.get_origin(base) is list and _item_type(base) is float:
        if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return [float(v) for v in value]
    elif typing.get_origin(base) is list:
        if isinstance(value, str):  # torchtitan users sometimes write "a,b"
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    elif base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif base is bool and isinstance(value, bool):
        return value
    elif base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif base is str and isinstance(value, str):
        return value
    raise ConfigError(f"{source}: '{key}' expects {_type_name(tp)}, got {value!r}")


# ---------------------------------------------------------------- building the config


def _apply_table(obj: Any, table: dict, prefix: str, source: str, given: set[str]) -> None:
    hints = _field_types(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for name, value in table.items():
        key = f"{prefix}{name}"
        if name not in fields:
            candidates = [f"{prefix}{n}" for n in fields] + all_keys()
            raise ConfigError(f"{source}: unknown key '{key}'{_closest(key, candidates)}")
        f = fields[name]
        if _is_section(f):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{key}' is a section ([{key}]), got {value!r}")
            _apply_table(getattr(obj, name), value, key + ".", source, given)
        else:
            setattr(obj, name, _check_toml_value(key, value, hints[name], source))
            given.add(key)


def _resolve(cfg: JobConfig, key: str) -> tuple[Any, str, dataclasses.Field, Any]:
    """Find the dataclass holding a dotted key; return (holder, leaf name, field, type)."""
    parts = key.split(".")
    holder = cfg
    for part in parts[:-1]:
        holder = getattr(holder, part, None)
        if holder is None or not dataclasses.is_dataclass(holder):
            raise ConfigError(f"unknown option '--{key}'{_closest(key, all_keys())}")
    fields = {f.name: f for f in dataclasses.fields(holder)}
    leaf = parts[-1]
    if leaf not in fields or _is_section(fields[leaf]):
        raise ConfigError(f"unknown option '--{key}'{_closest(key, all_keys())}")
    return holder, leaf, fields[leaf], _field_types(type(holder))[leaf]


def _split_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """Pair each `--key` with its value: `--k v`, `--k=v`, or a bare boolean flag (value None)."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': options look like --section.key value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            pairs.append((key, value))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((arg[2:], argv[i + 1]))
            i += 2
        else:
            pairs.append((arg[2:], None))
            i += 1
    return pairs


def _apply_cli(cfg: JobConfig, pairs: list[tuple[str, str | None]], given: set[str]) -> None:
    for key, value in pairs:
        negated = key.startswith("no-") or key.startswith("no_")
        lookup = key[3:] if negated and value is None else key
        holder, leaf, _, tp = _resolve(cfg, lookup)
        given.add(lookup)
        base, _ = _unwrap_optional(tp)
        if value is None:
            if base is not bool:
                raise ConfigError(f"--{key}: expects {_type_name(tp)} after it")
            setattr(holder, leaf, not negated)
        else:
            setattr(holder, leaf, _from_string(key, value, tp))


def load_toml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {quote_path(path)} does not exist")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid TOML: {exc}") from None


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from argv: `--job.config_file` (if any), then every other override."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = _split_cli(argv)
    cfg = JobConfig()
    config_files = list(dict.fromkeys(v for k, v in pairs if k == "job.config_file"))
    if len(config_files) > 1:
        raise ConfigError(f"'--job.config_file' is given {len(config_files)} different files "
                          f"({', '.join(map(repr, config_files))}); give one")
    config_file = config_files[0] if config_files else None
    given: set[str] = set()
    if config_file:
        _apply_table(cfg, load_toml(config_file), "", config_file, given)
    _apply_cli(cfg, pairs, given)
    cfg.job.config_file = config_file
    cfg.__dict__[_GIVEN] = frozenset(given - {"job.config_file"})
    return cfg


_GIVEN = "_given_keys"  # an attribute beside the fields: what the TOML and the command line set


def given_keys(cfg: JobConfig) -> frozenset[str]:
    """The dotted keys the TOML or the command line set (whatever their value), for checks that tell a setting the
    user made from a default; empty for a config built in code."""
    return cfg.__dict__.get(_GIVEN, frozenset())


# ---------------------------------------------------------------- help and printing


def help_text() -> str:
    lines = ["usage: python -m titan_lite.train [--job.config_file FILE] [--section.key VALUE ...]",
             "", "Options (CLI > TOML > default). Booleans: --key, --key=false. Lists: a,b,c.", ""]
    section = None
    for key, f, tp in iter_options():
        head = key.rsplit(".", 1)[0]
        if head != section:
            section = head
            lines.append(f"[{section}]")
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        extra = " (not supported: must stay at its default)" if meta.get("unsupported") else ""
        lines.append(f"  --{key} ({_type_name(tp)}, default {default!r}): {meta['help']}{extra}")
    return "\n".join(lines)


def to_toml(cfg: Any, prefix: str = "") -> str:
    """Serialise a config back to TOML (None values are omitted)."""
    scalars, tables = [], []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            tables.append(to_toml(value, f"{prefix}{f.name}."))
        elif value is not None:
            scalars.append(f"{f.name} = {_toml_value(value)}")
    out = ""
    if prefix and scalars:
        out += f"[{prefix[:-1]}]\n" + "\n".join(scalars) + "\n\n"
    return out + "".join(tables)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's string escapes (\n, \", \uXXXX) are also TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
