"""Write preference pairs (TRL's conversational format: one {"prompt": [...], "chosen": [...], "rejected": [...]}
object per line) from the synthetic conversations of scripts/make_synthetic_chat.py: each conversation gives one pair
at an assistant turn (the first one, where the assistant repeats the count it was just told; --turn any: a random
one), the prompt being the turns before it. With --kind follow (default) the system turn asks for answers in lower
case or in capitals, the chosen answer is the true turn written so and the rejected one the same turn written the
other way: a preference a model learns only by reading the system turn. With --kind count the chosen answer is the
true turn and the rejected one the same turn with a wrong count (a model learns it only once it copies and adds the
counts: far beyond a few minutes of a random base). Seeded, so the same command writes the same file.

    .venv/bin/python scripts/make_synthetic_preferences.py --chat data/synthetic_chat/train.jsonl \\
        --output data/synthetic_prefs/train.jsonl --seed 0
"""

import argparse
import json
import random
import re
import sys
from pathlib import Path

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.errors import ConfigError
from titan_lite.job.cli import ScriptParser
from titan_lite.job.outputs import check_not_input, check_output_file, write_output_file

NUMBER = re.compile(r"\d+")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--chat", required=True, help="a .jsonl of {\"messages\": [...]} conversations (as "
                                                      "scripts/make_synthetic_chat.py writes them)")
    parser.add_argument("--output", required=True, help="the .jsonl file of pairs to write (its folder is created)")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--turn", choices=["first", "any"], default="first",
                        help="the assistant turn a pair is made at: the first one, or any one")
    parser.add_argument("--kind", choices=["follow", "count"], default="follow",
                        help="follow: the answer written as the system turn asks (lower case or capitals) over the "
                             "other way; count: the right count over a wrong one")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output that holds something else (by default it is refused; one "
                             "that already holds exactly what this command writes is left as it is)")
    return parser.parse_args(argv)


def wrong(text: str, rng: random.Random) -> str:
    """The turn with every number replaced by another one (the same one for the same number)."""
    numbers = sorted({int(n) for n in NUMBER.findall(text)})
    changed = {n: n + rng.choice([-3, -2, -1, 1, 2, 3]) if n > 3 else n + rng.randint(1, 4) for n in numbers}
    return NUMBER.sub(lambda m: str(changed[int(m.group())]), text)


# --kind follow: what the system turn asks for, and how an answer is written so
CASES = {"lower": ("Answer in lower case.", str.lower), "upper": ("Answer in capitals.", str.upper)}


def make_pair(messages: list[dict[str, str]], rng: random.Random, turn: str, kind: str) -> dict | None:
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and NUMBER.search(m["content"])]
    if not turns:
        return None
    at = turns[0] if turn == "first" else rng.choice(turns)
    chosen, prompt = messages[at]["content"], messages[:at]
    if kind == "count":
        worse = wrong(chosen, rng)
    else:
        asked, other = rng.sample(sorted(CASES), 2)
        prompt = [{"role": "system", "content": CASES[asked][0]}] + [m for m in prompt if m["role"] != "system"]
        chosen, worse = CASES[asked][1](chosen), CASES[other][1](chosen)
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": worse}]}


def read_pairs(args: argparse.Namespace) -> list[dict]:
    source = Path(args.chat)
    if not source.is_file():
        raise ConfigError(f"--chat '{source}' is not a file (write it with scripts/make_synthetic_chat.py)")
    check_output_file("--output", args.output)
    check_not_input("--output", args.output, {"--chat": source})
    rng = random.Random(args.seed)
    pairs = []
    for line_no, line in enumerate(source.read_text().splitlines(), start=1):
        if line.strip():
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{source}:{line_no}: not a {{\"messages\": [...]}} object") from None
            pair = make_pair(messages, rng, args.turn, args.kind)
            if pair is not None:
                pairs.append(pair)
    return pairs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        pairs = read_pairs(args)
        written = write_output_file("--output", args.output, "".join(json.dumps(p) + "\n" for p in pairs),
                                    args.overwrite)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = (f"{len(pairs)} preference pairs (at the {args.turn} assistant turn of each conversation of {args.chat}, "
            f"kind {args.kind}; seed {args.seed})")
    print(f"wrote {what} to {args.output}" if written else f"{args.output} already holds {what}: left as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main())
