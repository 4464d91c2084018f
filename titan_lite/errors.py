"""The errors that end a run with one line instead of a traceback, and the exit code of each."""

import difflib
import os
import sys

# Exit codes of titan_lite.train (run_train.sh passes them on): a user error, a training fault, a hung collective,
# and DRY_RUN's "the plan is fine but files the run reads are missing".
USER_ERROR = 2
FAULT = 3
HANG = 4
MISSING_FILES = 5


class ConfigError(ValueError):
    """A user error: the message is one line naming the key, file or value and what is expected."""


class TrainingFault(RuntimeError):
    """A fault found while training (a non-finite loss, a checkpoint that cannot be written): one line naming the
    step and what happened; checkpoints already written stay intact."""


def quote_path(path: object) -> str:
    """How an error names a path: quoted, and a relative one with the folder it was resolved against (a run
    started from another directory is the usual reason a path 'does not exist')."""
    text = str(path)
    if text.startswith("/"):
        return f"'{text}'"
    return f"'{text}' (relative to the current directory {os.getcwd()})"


def did_you_mean(value: str, candidates: list[str]) -> str:
    """' (did you mean 'x'?)' for the closest candidate, or '' when none is close."""
    match = difflib.get_close_matches(value, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pip_install(*packages: str, extra: str | None = None) -> str:
    """The command that installs into the Python running now, for an error line to tell: the checkout's
    `.venv/bin/pip` when that is the environment, else this interpreter's `-m pip` (a bare `pip` may belong to
    another environment). `extra`: the checkout's optional extra (`-e '.[eval]'`), named from where the user is."""
    venv = os.path.join(CHECKOUT, ".venv")
    here = os.getcwd()
    if os.path.abspath(sys.prefix) == venv:
        command = ".venv/bin/pip install" if here == CHECKOUT else f"{venv}/bin/pip install"
    else:
        command = f"{sys.executable} -m pip install"
    if extra:
        packages = (*packages, "-e", f"'.[{extra}]'" if here == CHECKOUT else f"'{CHECKOUT}[{extra}]'")
    return " ".join([command, *packages])
