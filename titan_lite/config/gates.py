"""Settings that take effect only behind a switch, and the one line for a setting changed while its switch is off.

The switches are read from the schema (config/schema.py), so a section or key added later is covered by how it is
declared, with no change here:
- a section's `converter`: the section is read only when model.converters lists it;
- a section's `read_when`: a condition on other keys ([instruct]: an instruct dataset);
- a section's boolean `enable`: every other key of the section and of its sub-sections (keys declared `needs=None`
  are read either way, e.g. checkpoint.initial_load_path);
- a boolean `enable_<name>`: the keys of its section that name it in `needs`, or whose name contains <name>
  (metrics.enable_wandb switches a later wandb_project);
- a key's `needs` naming a boolean key elsewhere ('checkpoint.last_save_in_hf');
- a key's `needs` as a condition on another key's value (schema.When: preference.simpo_gamma is read only when
  preference.loss is 'simpo').
A setting changed from its default behind a switch that is off is refused with one line, or warned about in the
same words where the section is declared `inert` (see the comment above schema.JobConfig for which and why).
"""

import dataclasses
import functools
import logging
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from titan_lite.config.manager import given_keys, iter_options, iter_sections
from titan_lite.config.schema import AUTO, JobConfig, When
from titan_lite.errors import ConfigError

logger = logging.getLogger("titan_lite")
ENABLE = "enable"


def value_at(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@dataclass(frozen=True)
class Switch:
    """What must hold for some settings to take effect, and how their one line says it."""

    is_on: Callable[[JobConfig], bool]
    reason: Callable[[JobConfig, bool], str]  # (config, several settings) -> why they have no effect
    fix: Callable[[JobConfig], str]  # what turns the switch on
    key: str | None = None  # the boolean key that is the switch, if one is


@dataclass(frozen=True)
class Gate:
    """The settings (dotted keys) behind one switch; `label` names their section in the line."""

    switch: Switch
    label: str
    keys: tuple[str, ...]
    inert: bool  # a warning, not a refusal


def key_switch(key: str | tuple[str, ...]) -> Switch:
    """A boolean key that must be true (or several, one of which must be)."""
    keys = (key,) if isinstance(key, str) else key
    named = " or ".join(f"'{k}'" for k in keys)
    off = "that is false" if len(keys) == 1 else "each is false"

    def reason(cfg: JobConfig, several: bool) -> str:
        return f"{'they take' if several else 'it takes'} effect only with {named} = true, and {off}"
    return Switch(lambda cfg: any(bool(value_at(cfg, k)) for k in keys), reason,
                  lambda cfg: "set " + " or ".join(f"--{k}" for k in keys), keys[0] if len(keys) == 1 else None)


def when_switch(section: str, when: When) -> Switch:
    """A condition on another key's value (that key of the same section unless dotted)."""
    key = when.key if "." in when.key else f"{section}.{when.key}"

    def reason(cfg: JobConfig, several: bool) -> str:
        return (f"{'they take' if several else 'it takes'} effect only when '{key}' {when.text}, and it is "
                f"{value_at(cfg, key)!r}")
    return Switch(lambda cfg: when.holds(value_at(cfg, key)), reason, lambda cfg: f"set {when.fix}")


def needs_switch(section: str, needs: str | tuple[str, ...] | When) -> Switch:
    return when_switch(section, needs) if isinstance(needs, When) else key_switch(needs)


def converter_switch(section: str, converter: str) -> Switch:
    def reason(cfg: JobConfig, several: bool) -> str:
        return (f"[{section}] is read only by the '{converter}' converter, which 'model.converters' = "
                f"{cfg.model.converters} does not list")
    return Switch(lambda cfg: converter in cfg.model.converters, reason,
                  lambda cfg: f"add it (--model.converters {','.join([*cfg.model.converters, converter])})")


def read_when_switch(section: str, read_when) -> Switch:
    return Switch(read_when.holds, lambda cfg, several: f"[{section}] is read only when {read_when.text}, which is "
                                                        "not the case here", lambda cfg: read_when.fix)


def _leaves(cls: type, prefix: str) -> Iterator[tuple[str, dataclasses.Field]]:
    for leaf, f, _ in iter_options(cls):
        yield f"{prefix}.{leaf}", f


@functools.cache
def gates(schema: type = JobConfig) -> tuple[Gate, ...]:
    """Every switch of the schema with the keys behind it: whole-section switches (converter, read_when) first,
    then `enable` keys, then per-key switches (a key is reported under the first gate that is off)."""
    whole, enabled, per_key = [], [], []
    for section, f, cls in iter_sections(schema):
        inert = bool(f.metadata.get("inert"))
        leaves = dict(_leaves(cls, section))
        if f.metadata.get("converter"):
            whole.append(Gate(converter_switch(section, f.metadata["converter"]), section, tuple(leaves), inert))
        if f.metadata.get("read_when"):
            whole.append(Gate(read_when_switch(section, f.metadata["read_when"]), section, tuple(leaves), inert))
        switches = switch_names(cls)
        claimed: set[str] = set()
        for name in switches:
            behind = [key for key, g in leaves.items() if _needs(key, g, section, switches) == f"{section}.{name}"]
            claimed |= set(behind)
            if behind:
                per_key.append(Gate(key_switch(f"{section}.{name}"), section, tuple(behind), inert))
        for key, g in leaves.items():
            needs = _needs(key, g, section, switches)
            if needs and (not isinstance(needs, str) or not needs.startswith(f"{section}.")) and key not in claimed:
                per_key.append(Gate(needs_switch(section, needs), section, (key,), inert))
                claimed.add(key)
        if ENABLE in switches:
            rest = [key for key, g in leaves.items() if key != f"{section}.{ENABLE}" and key not in claimed
                    and g.metadata.get("needs", AUTO) is not None]
            enabled.append(Gate(key_switch(f"{section}.{ENABLE}"), section, tuple(rest), inert))
    return tuple(whole + enabled + per_key)


def switch_names(cls: type) -> list[str]:
    """The section's own boolean keys named `enable` or `enable_<name>`."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls)
            if hints[f.name] is bool and (f.name == ENABLE or f.name.startswith(ENABLE + "_"))]


def _needs(key: str, f: dataclasses.Field, section: str,
           switches: list[str]) -> str | tuple[str, ...] | When | None:
    """The dotted boolean key (or keys, any of which will do, or the condition) that `key` takes effect behind besides
    its section's `enable` (None: none): its declared `needs`, else the section's `enable_<name>` whose <name> its
    own name contains."""
    needs = f.metadata.get("needs", AUTO)
    leaf = key.removeprefix(f"{section}.")
    if needs is None or leaf in switches:
        return None
    if isinstance(needs, When):
        return needs
    if isinstance(needs, tuple):
        return tuple(n if "." in n else f"{section}.{n}" for n in needs)
    if needs != AUTO:
        return needs if "." in needs else f"{section}.{needs}"
    if "." in leaf:  # a key of a sub-section: that section's own switches decide
        return None
    for name in switches:
        if name != ENABLE and name.removeprefix(ENABLE + "_") in leaf:
            return f"{section}.{name}"
    return None


def switched_off_settings(cfg: JobConfig) -> list[tuple[str, bool]]:
    """(the one line, whether it is only a warning) for each group of settings changed from their defaults behind
    a switch that is off. Refused settings of a section are only a warning where the TOML or the command line set
    its switch to false in so many words: a section turned off on purpose (`--distill.enable=false` for a control
    run) keeps its other keys; one whose switch was never named was set for nothing."""
    defaults = type(cfg)()
    given = given_keys(cfg)
    reported: set[str] = set()
    found = []
    for gate in gates(type(cfg)):
        if gate.switch.is_on(cfg):
            continue
        changed = [(key, value_at(cfg, key)) for key in gate.keys
                   if key not in reported and value_at(cfg, key) != value_at(defaults, key)]
        if not changed:
            continue
        reported |= {key for key, _ in changed}
        first, value = changed[0]
        n = len(changed) - 1
        more = f" (and {n} more [{gate.label}] setting{'s' * (n > 1)})" if n else ""
        turned_off = gate.switch.key in given
        found.append((f"'{first}' = {value!r}{more} has no effect: {gate.switch.reason(cfg, bool(n))}; "
                      f"{gate.switch.fix(cfg)} or drop the setting", gate.inert or turned_off))
    return found


def check_switched_off(cfg: JobConfig) -> None:
    """Refuse the first setting that a switch turned off makes ineffective; warn about those of inert sections."""
    found = switched_off_settings(cfg)
    refused = [line for line, inert in found if not inert]
    if refused:
        raise ConfigError(refused[0])
    for line, _ in found:
        logger.warning(line)
