"""The job config: schema, TOML + CLI loading, and validation."""

from titan_lite.config.manager import help_text, parse_args, to_toml
from titan_lite.config.schema import JobConfig
from titan_lite.config.validate import validate

__all__ = ["JobConfig", "help_text", "parse_args", "to_toml", "validate"]
