"""ConfigError: the one exception type for user errors, printed as a single line naming the key, file or value."""


class ConfigError(ValueError):
    """A user error: the message is one line naming the key, file or value and what is expected."""
