"""Final-answer extraction for math word problems (GSM8K, MetaMathQA): the number a completion ends on, normalised,
and whether it equals the reference."""

import re
from fractions import Fraction

# GSM8K's "#### 42", MetaMathQA's "The answer is: 42", a LaTeX \boxed{42}, in order of preference.
_MARKED = [re.compile(r"####\s*(.+)"), re.compile(r"[Tt]he (?:final )?answer is:?\s*(.+)"),
           re.compile(r"\\boxed\{([^{}]+)\}")]
_NUMBER = re.compile(r"-?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")


def normalise_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '$-3' -> '-3', '3/4' -> '3/4' (reduced); None when no number."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    raw = match.group(0).replace("$", "").replace(",", "").replace(" ", "")
    try:
        value = Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None
    if value.denominator == 1:
        return str(value.numerator)
    as_float = float(value)
    if "/" not in raw:
        return f"{as_float:.10g}"
    return f"{value.numerator}/{value.denominator}"


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the number after a marker (####, 'The answer is', \\boxed{}), else the
    last number in the text; normalised (normalise_number). None when there is no number."""
    for pattern in _MARKED:
        found = pattern.findall(text)
        if found:
            number = normalise_number(found[-1])
            if number is not None:
                return number
    numbers = list(_NUMBER.finditer(text))
    return normalise_number(numbers[-1].group(0)) if numbers else None


def same_answer(completion: str, reference: str) -> bool:
    """Whether a completion's final answer equals the reference's (both extracted the same way)."""
    ours, theirs = extract_answer(completion), extract_answer(reference)
    return ours is not None and ours == theirs
