"""Write a small synthetic multi-turn conversation set in OpenAI's `messages` format (one {"messages": [...]} object
per line): a user keeps count of someone's things over a few turns, the assistant states each new total, and the
last question asks for the count (or the count after one more change), answered with "#### N". Seeded, so the same
command writes the same file; lengths vary from one exchange to five (many short, few long), like real chat data.

With --tokenizer_output it also writes the tokenizer folder the CPU chat example trains with: the bundled debug BPE
(assets/tokenizer) as a Hugging Face tokenizer.json with ChatML's special tokens (<|endoftext|>, <|im_start|>,
<|im_end|>; ids 1792-1794, then reserved tokens up to the debug model's 2,048) and a tokenizer_config.json
holding the ChatML chat template.

    .venv/bin/python scripts/make_synthetic_chat.py --output data/synthetic_chat/train.jsonl \\
        --num_conversations 3000 --seed 0 --tokenizer_output data/synthetic_chat/tokenizer
"""

import argparse
import json
import random
import sys
from pathlib import Path

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.data.tokenizer import LLAMA3_PATTERN, byte_level_alphabet, parse_tiktoken_file
from titan_lite.errors import ConfigError
from titan_lite.folders import FOLDER_HELP, check_replaceable, output_folder
from titan_lite.job.cli import ScriptParser
from titan_lite.job.outputs import check_output_file, write_output_file

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "tokenizer.model"
CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = 2048  # the debug model's
# ChatML as OpenHermes 2.5 and Qwen 1.5 publish it (no default system turn).
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
NAMES = ("Tom", "Sara", "Ali", "Mia", "Ben", "Lea")
ITEMS = ("apples", "pens", "books", "coins", "cards", "eggs")
SYSTEMS = ("You keep count of things for the user.", "You are a careful assistant. Answer with numbers.")
UPDATES_WEIGHTS = (40, 30, 20, 10)  # how many changes before the question: 0, 1, 2 or 3


def make_conversation(rng: random.Random, largest: int) -> list[dict[str, str]]:
    """One conversation: a starting count, 0-3 changes each answered with the new total, then the question."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(0, largest)
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
    messages += [{"role": "user", "content": f"{name} has {count} {item}."},
                 {"role": "assistant", "content": f"Noted: {name} has {count} {item}."}]
    for _ in range(rng.choices(range(len(UPDATES_WEIGHTS)), UPDATES_WEIGHTS)[0]):
        change, count, phrase = _change(rng, count, largest)
        messages += [{"role": "user", "content": f"{name} {phrase} {change} {item}."},
                     {"role": "assistant", "content": f"Now {name} has {count} {item}."}]
    if rng.random() < 0.5:
        question, answer = f"How many {item} does {name} have?", count
    else:
        change, answer, phrase = _change(rng, count, largest)
        question = f"If {name} {phrase} {change} {item}, how many would {name} have?"
    messages += [{"role": "user", "content": question},
                 {"role": "assistant", "content": f"{name} would have {answer} {item}.\n#### {answer}"
                  if question.startswith("If") else f"{name} has {answer} {item}.\n#### {answer}"}]
    return messages


def _change(rng: random.Random, count: int, largest: int) -> tuple[int, int, str]:
    """(amount, new count, verb phrase): gets more, or gives some away (never below zero)."""
    if count > 0 and rng.random() < 0.5:
        amount = rng.randint(1, count)
        return amount, count - amount, "gives away"
    amount = rng.randint(1, largest)
    return amount, count + amount, "gets"


def chat_tokenizer_folder(folder: Path) -> Path:
    """The bundled BPE as an HF tokenizer folder with ChatML's special tokens (ids 1792-1794) and template."""
    ranks = parse_tiktoken_file(BUNDLED_TOKENIZER.read_bytes())
    alphabet = byte_level_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []  # every split of a token into two tokens, in the order of the token's rank (tiktoken's priority)
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], text(a), text(b)) for a, b in splits]
    # reserved tokens up to the debug model's 2,048 (as Llama 3 reserves its unused special ids): every id the model
    # can produce decodes
    specials = [*CHATML_TOKENS, *(f"<|reserved_special_token_{i}|>" for i in range(VOCAB - len(ranks) - 3))]
    added = [{"id": len(ranks) + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(specials)]
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                 "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                      "vocab": {text(t): r for t, r in ranks.items()},
                      "merges": [[a, b] for *_, a, b in sorted(merges)]}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False, "model_max_length": 2048,
              "chat_template": CHATML_TEMPLATE}
    with output_folder("--tokenizer_output", folder) as partial:
        (partial / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
        (partial / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--output", required=True, help="the .jsonl file to write (its folder is created)")
    parser.add_argument("--num_conversations", type=int, default=3000, help="conversations to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--max_count", type=int, default=9, help="counts and changes are 0..max_count")
    parser.add_argument("--tokenizer_output", help="also write the ChatML tokenizer folder of the CPU chat example: "
                                                   f"{FOLDER_HELP}")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output that holds something else (by default it is refused; one "
                             "that already holds exactly what this command writes is left as it is)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    problems = [f"--num_conversations must be at least 1, got {opts.num_conversations}"] * (opts.num_conversations < 1)
    problems += [f"--max_count must be at least 1, got {opts.max_count}"] * (opts.max_count < 1)
    problems += [f"--output {opts.output!r} must end in .jsonl"] * (not opts.output.endswith(".jsonl"))
    try:
        check_output_file("--output", opts.output)
        if opts.tokenizer_output:  # never files mixed into a folder of the user's
            check_replaceable("--tokenizer_output", opts.tokenizer_output)
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    rng = random.Random(opts.seed)
    conversations = []
    for i in range(opts.num_conversations):
        conversations.append(make_conversation(rng, opts.max_count))
        if (i + 1) % max(1, opts.num_conversations // 4) == 0:
            print(f"{i + 1}/{opts.num_conversations} conversations", flush=True)
    try:
        written = write_output_file("--output", opts.output,
                                    "".join(json.dumps({"messages": m}) + "\n" for m in conversations), opts.overwrite)
        tokenizer = f"; ChatML tokenizer folder {chat_tokenizer_folder(Path(opts.tokenizer_output))}" \
            if opts.tokenizer_output else ""
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    turns = sum(len(m) for m in conversations)
    what = f"{len(conversations)} conversations ({turns} turns; counts 0..{opts.max_count}; seed {opts.seed})"
    print((f"wrote {what} to {opts.output}" if written else f"{opts.output} already holds {what}: left as it is")
          + tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
