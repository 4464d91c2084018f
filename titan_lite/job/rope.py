"""[model.rope]: the TOML's RoPE settings laid over the flavor's or config.json's, each impossible one a line."""

from dataclasses import fields, replace

from titan_lite.config.schema import RoPE
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs

# [model.rope] key -> the LlamaArgs field it sets, and the scaling types that read it (None: every type).
_KEYS = {
    "rope_factor": ("rope_scaling_factor", None),
    "original_seq_len": ("rope_original_max_seq_len", ("llama3", "yarn")),
    "beta_fast": ("rope_beta_fast", ("yarn",)),
    "beta_slow": ("rope_beta_slow", ("yarn",)),
    "truncate": ("rope_truncate", ("yarn",)),
    "attention_factor": ("rope_attention_factor", ("yarn",)),
    "low_freq_factor": ("rope_low_freq_factor", ("llama3",)),
    "high_freq_factor": ("rope_high_freq_factor", ("llama3",)),
}
_ALIASES = {"llama": "llama3"}  # torchtitan's name of Llama 3.1's scaling


def apply_rope_settings(args: LlamaArgs, rope: RoPE) -> LlamaArgs:
    """The args with [model.rope]'s set keys; a key that the resulting scaling would not read, a new scaling type
    without its factor, yarn without original_seq_len: one ConfigError line each."""
    if rope.theta is not None:
        if rope.theta <= 0:
            raise ConfigError(f"'model.rope.theta' must be positive, got {rope.theta}")
        args = replace(args, rope_theta=float(rope.theta))
    kind = _scaling_type(args, rope)
    given = {key: getattr(rope, key) for key in _KEYS if getattr(rope, key) is not None}
    if kind is None:
        if given:
            key = next(iter(given))
            raise ConfigError(f"'model.rope.{key}' = {given[key]!r} has no effect: the model has no RoPE scaling "
                              "(set 'model.rope.scaling' to yarn, llama or linear)")
        return replace(args, rope_scaling_factor=None)
    for key in given:
        readers = _KEYS[key][1]
        if readers is not None and kind not in readers:
            raise ConfigError(f"'model.rope.{key}' is read only by {' and '.join(readers)} scaling, not "
                              f"'model.rope.scaling' = '{kind}'")
    if kind != _current_type(args):
        args = _fresh_scaling(args, kind, given)
    args = replace(args, **{_KEYS[key][0]: value for key, value in given.items()})
    if "rope_factor" in given and not args.rope_scaling_factor >= 1:  # config.json's own factor: models/hf/rope.py
        raise ConfigError(f"'model.rope.rope_factor' must be at least 1 (the factor the context grows by), got "
                          f"{args.rope_scaling_factor}")
    return args


def _current_type(args: LlamaArgs) -> str | None:
    return None if args.rope_scaling_factor is None else args.rope_scaling_type


def _scaling_type(args: LlamaArgs, rope: RoPE) -> str | None:
    """The scaling type of the run: model.rope.scaling, else the model's own (None: plain RoPE)."""
    if rope.scaling is None:
        return _current_type(args)
    return None if rope.scaling == "none" else _ALIASES.get(rope.scaling, rope.scaling)


def _fresh_scaling(args: LlamaArgs, kind: str, given: dict) -> LlamaArgs:
    """The args with a scaling type the model did not have: its parameters start at transformers' defaults."""
    if "rope_factor" not in given:
        raise ConfigError(f"'model.rope.scaling' = '{kind}' needs 'model.rope.rope_factor' (the factor the context "
                          "grows by, e.g. 4.0)")
    if kind == "yarn" and "original_seq_len" not in given:
        raise ConfigError("'model.rope.scaling' = 'yarn' needs 'model.rope.original_seq_len' (the context length the "
                          "model was pre-trained with, e.g. 32768 for Qwen2.5/Qwen3)")
    defaults = LlamaArgs()
    reset = {f.name: getattr(defaults, f.name) for f in fields(LlamaArgs)
             if f.name.startswith("rope_") and f.name != "rope_theta"}
    return replace(args, **{**reset, "rope_scaling_type": kind})
