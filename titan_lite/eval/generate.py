"""Generation moved to titan_lite/generate/ (used by evaluation, scripts and RL rollouts alike); these names stay
importable from here."""

from titan_lite.generate import (  # noqa: F401
    Completion,
    GenerationConfig,
    KVCache,
    LayerView,
    generate,
    generate_text,
    iter_completions,
    left_padded,
    prompts_of,
)
