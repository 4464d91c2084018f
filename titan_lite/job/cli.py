"""The scripts' command lines, without torch (so that --help and argument errors are quick): help with every
option's default, and each option spelled with underscores like the trainer's, the dashed spelling an alias."""

import argparse
import sys


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring's layout kept; every option's default appended to its help unless it has none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action.default, list) and not action.default:
            return text
        return f"{text} (default: %(default)s)"


class ScriptParser(argparse.ArgumentParser):
    """The scripts' parser: description and epilog from the module docstring (first paragraph, then the rest),
    defaults in the help, and every option spelled with underscores like the trainer's, the dashed spelling
    (`--max-shard-gb` for `--max_shard_gb`) accepted as an alias."""

    def __init__(self, doc: str | None = None, **kwargs):
        if doc is not None:
            first, _, rest = doc.strip().partition("\n\n")
            kwargs.setdefault("description", " ".join(first.split()))
            kwargs.setdefault("epilog", rest or None)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(**kwargs)

    def _option_names(self) -> set[str]:
        names = set(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    names |= set(sub._option_string_actions)
        return names

    def normalize(self, argv: list[str]) -> list[str]:
        """`--a-b` -> `--a_b` (and `--a_b` -> `--a-b`) where only the other spelling is an option."""
        known, out = self._option_names(), []
        for word in argv:
            name, eq, value = word.partition("=")
            if word.startswith("--") and name not in known:
                for other in ("--" + name[2:].replace("-", "_"), "--" + name[2:].replace("_", "-")):
                    if other in known:
                        word = other + eq + value
                        break
            out.append(word)
        return out

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(self.normalize(list(sys.argv[1:] if args is None else args)), namespace)
