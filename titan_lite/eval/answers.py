"""Answer extraction moved to titan_lite/rl/answers.py (RL's answer_match reward and evaluation share it); these names
stay importable from here."""

from titan_lite.rl.answers import extract_answer, normalise_number, same_answer  # noqa: F401
