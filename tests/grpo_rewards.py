"""A reward function for the GRPO tests (a user's 'module.path:function'): the share of vowels in a completion, so a
random tiny model's completions differ in reward."""


def vowels(completions, **kwargs) -> list[float]:
    return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]


def bare(x):
    """Not TRL's signature: reward functions are called by keyword (prompts=, completions=, ...)."""
    return [0.0] * len(x)


def not_a_number(completions, **kwargs) -> list[float]:
    return [float("nan") if "nan" in c else 1.0 for c in completions]
