"""The chat workflow as a user runs it: scripts/make_synthetic_chat.py (conversations and the ChatML tokenizer),
scripts/show_data.py on the CPU example's config (its ids against transformers' rendering), generation and answer
accuracy with --chat."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chat_script():
    spec = importlib.util.spec_from_file_location("make_synthetic_chat", ROOT / "scripts" / "make_synthetic_chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
