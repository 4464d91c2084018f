"""Write small synthetic arithmetic word problems in GSM8K's JSONL format: one {"question", "answer"} object per line,
the answer's last line "#### N" (GSM8K's <<a+b=c>> calculator annotations are left out), seeded, so the same command
writes the same file. Small enough that a tiny model learns some of them on a CPU in minutes.

    .venv/bin/python scripts/make_synthetic_gsm8k.py --output data/synthetic_gsm8k/train.jsonl \\
        --num_problems 2000 --seed 0
"""

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.errors import ConfigError
from titan_lite.job.cli import ScriptParser
from titan_lite.job.outputs import check_output_file, write_output_file

NAMES = ("Tom", "Sara", "Ali", "Mia", "Ben", "Lea")
ITEMS = ("apples", "pens", "books", "coins", "cards", "eggs")
OPERATIONS = {"add": "+", "sub": "-", "mul": "*"}


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str

    def record(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.answer}


def _operands(rng: random.Random, op: str, largest: int) -> tuple[int, int]:
    a, b = rng.randint(0, largest), rng.randint(0, largest)
    return (max(a, b), min(a, b)) if op == "sub" else (a, b)  # no negative results


def make_problem(rng: random.Random, op: str, largest: int) -> Problem:
    """One problem of operation `op` with operands 0..largest, in one of a few phrasings."""
    a, b = _operands(rng, op, largest)
    result = {"add": a + b, "sub": a - b, "mul": a * b}[op]
    sign = OPERATIONS[op]
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    phrasings = {
        "add": [f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
                f"There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?"],
        "sub": [f"{name} has {a} {item} and gives away {b}. How many {item} are left?",
                f"A shop had {a} {item} and sold {b}. How many {item} does it have now?"],
        "mul": [f"{name} buys {a} bags with {b} {item} in each. How many {item} does {name} buy?",
                f"There are {a} rows of {b} {item}. How many {item} are there?"],
    }
    question = rng.choice([f"What is {a} {sign} {b}?", *phrasings[op]])
    return Problem(question, f"{a} {sign} {b} = {result}\n#### {result}")


def make_problems(count: int, seed: int, largest: int, ops: list[str], progress=None) -> list[Problem]:
    rng = random.Random(seed)
    problems = []
    for i in range(count):
        problems.append(make_problem(rng, rng.choice(ops), largest))
        if progress is not None and (i + 1) % max(1, count // 5) == 0:
            progress(i + 1)
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--output", required=True, help="the .jsonl file to write (its folder is created)")
    parser.add_argument("--num_problems", type=int, default=2000, help="problems to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--max_operand", type=int, default=9, help="operands are 0..max_operand")
    parser.add_argument("--ops", default="add,sub", help="comma-separated operations among add, sub, mul "
                                                         "(default add,sub)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output that holds something else (by default it is refused; one "
                             "that already holds exactly what this command writes is left as it is)")
    return parser.parse_args(argv)


def checked_ops(opts: argparse.Namespace) -> list[str]:
    ops = [op.strip() for op in opts.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPERATIONS]
    if not ops or unknown:
        raise ValueError(f"--ops {opts.ops!r}: expected a comma-separated list of {', '.join(OPERATIONS)}")
    if opts.num_problems < 1:
        raise ValueError(f"--num_problems must be at least 1, got {opts.num_problems}")
    if opts.max_operand < 1:
        raise ValueError(f"--max_operand must be at least 1, got {opts.max_operand}")
    if not opts.output.endswith(".jsonl"):
        raise ValueError(f"--output {opts.output!r} must end in .jsonl")
    try:
        check_output_file("--output", opts.output)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return ops


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        ops = checked_ops(opts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problems = make_problems(opts.num_problems, opts.seed, opts.max_operand, ops,
                             progress=lambda n: print(f"{n}/{opts.num_problems} problems", flush=True))
    try:
        written = write_output_file("--output", opts.output, "".join(json.dumps(p.record()) + "\n" for p in problems),
                                    opts.overwrite)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = f"{len(problems)} problems ({', '.join(ops)}; operands 0..{opts.max_operand}; seed {opts.seed})"
    print(f"wrote {what} to {opts.output}" if written else f"{opts.output} already holds {what}: left as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main())
