"""Write the small local lm_eval tasks in assets/lm_eval_tasks/ from the bundled Shakespeare (A Midsummer Night's
Dream, the corpus's validation play), one JSONL per task, seeded, so the same command writes the same files:
shakespeare_choice (multiple choice: the next line among four), shakespeare_rolling (perplexity of speeches) and
shakespeare_continue (greedy completion of a line). A task file that holds something else (another seed's, or a
user's own) is replaced only with --overwrite; otherwise nothing is written and the line names it.

    .venv/bin/python scripts/make_lm_eval_tasks.py --output_dir assets/lm_eval_tasks
"""

import argparse
import json
import random
import sys
from pathlib import Path

from titan_lite.errors import USER_ERROR, ConfigError
from titan_lite.job.cli import ScriptParser
from titan_lite.job.outputs import needs_writing, write_output_file

PLAY = Path(__file__).resolve().parents[1] / "titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt"


def speeches(text: str) -> list[list[str]]:
    """The play's speeches: runs of verse lines after a speaker's name (a line in capitals)."""
    found, current = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("["):
            if current:
                found.append(current)
            current = None
        elif line.isupper() and len(line.split()) <= 3:
            current = []
        elif current is not None:
            current.append(line)
    return [s for s in found if len(s) >= 2]


def choice_docs(lines: list[tuple[str, str]], rng: random.Random, count: int) -> list[dict]:
    """A line, then its true next line among three next lines of other pairs."""
    docs = []
    for first, second in rng.sample(lines, count):
        wrong = [b for _, b in rng.sample(lines, 8) if b != second][:3]
        choices = [second, *wrong]
        rng.shuffle(choices)
        docs.append({"context": first, "choices": choices, "label": choices.index(second)})
    return docs


def rolling_docs(all_speeches: list[list[str]], rng: random.Random, count: int) -> list[dict]:
    return [{"text": "\n".join(s)} for s in rng.sample([s for s in all_speeches if 3 <= len(s) <= 8], count)]


def continue_docs(lines: list[tuple[str, str]], rng: random.Random, count: int) -> list[dict]:
    """The first half of a line's words; the target is the rest."""
    docs = []
    for line, _ in rng.sample([p for p in lines if len(p[0].split()) >= 6], count):
        words = line.split()
        half = len(words) // 2
        docs.append({"prompt": " ".join(words[:half]), "target": " ".join(words[half:])})
    return docs


def jsonl(docs: list[dict]) -> str:
    return "".join(json.dumps(d) + "\n" for d in docs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--output_dir", default="assets/lm_eval_tasks", help="where the JSONL files go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the choice of lines and distractors")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace task files that hold something else (by default they are refused and nothing "
                             "is written; one that already holds exactly what this command writes is left as it is)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    all_speeches = speeches(PLAY.read_text())
    pairs = [(s[i], s[i + 1]) for s in all_speeches for i in range(len(s) - 1)]
    out = Path(opts.output_dir)
    if not out.is_dir():
        print(f"error: --output_dir '{out}' is not a folder", file=sys.stderr)
        return 2
    rng = random.Random(opts.seed)
    tasks = {"shakespeare_choice": choice_docs(pairs, rng, 40),
             "shakespeare_rolling": rolling_docs(all_speeches, rng, 16),
             "shakespeare_continue": continue_docs(pairs, rng, 16)}
    files = {out / f"{name}.jsonl": jsonl(docs) for name, docs in tasks.items()}
    try:
        for path, text in files.items():  # every file checked before any is written
            needs_writing("--output_dir", path, text, opts.overwrite)
        for path, text in files.items():
            write_output_file("--output_dir", path, text, opts.overwrite)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    print(f"wrote {', '.join(f'{name}.jsonl ({len(docs)} docs)' for name, docs in tasks.items())} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
