"""The errors that end a run with one line instead of a traceback, and the exit code of each."""

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
