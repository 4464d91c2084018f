"""Data at scale: one rank's loader tokens/s at data-parallel degrees 1, 8, 64 and 512 (rank 0's loader built with
that degree, local batch 1), raw text (tokenized by every rank) against token files (each rank reads its own); two
DataLoader workers against one, on token files and on raw text (where the workers' threads share the tokenizing);
documents encoded by 1 and 2 threads with each tokenizer back end (and whether the library cores release the GIL);
scripts/tokenize_data.py's tokens/s against its number of processes, and on text, chat and preference rows with
the same tokenizer; and the tokenizer on the same text: titan_lite's tokenizer.json BPE on tiktoken's core and in
Python, HF `tokenizers` and a plain tiktoken encoding of the same ranks and pattern, with the tokenizer.json of the
figures and with one of SmolLM2's size lacking the 21 single bytes SmolLM2's vocabulary lacks.

    .venv/bin/python -m benchmarks.data_loading            # every figure (a few minutes on 2 busy cores)
    .venv/bin/python -m benchmarks.data_loading --smoke    # tiny sizes: checks that every part runs (seconds)
    .venv/bin/python -m benchmarks.data_loading --parts rows smollm2   # some parts only

The text is the bundled Shakespeare plays as JSON lines of 3,000 characters; the tokenizer.json is a byte-level BPE
trained with `tokenizers` on them in SmolLM2's structure (Digits then ByteLevel, 16,384 tokens). The chat rows are
conversations of the plays' lines (a system turn, one to four exchanges), the preference rows the same conversations
with their last answer chosen and another line rejected, all three kinds tokenized with the ChatML tokenizer of
scripts/make_synthetic_chat.py. The plays hold only 19,614 distinct tokens' worth of text: the SmolLM2-sized
vocabulary (49,152 tokens) is trained on them and on the Python standard library's top-level modules (SmolLM2 itself
cannot be downloaded here), without the single bytes 4, 6, 19, 20, 22, 29, 192, 193, 241, 242 and 245-255.
"""

import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path

from benchmarks import cli
from titan_lite.config import parse_args as parse_config
from titan_lite.data.dataloader import BatchLayout, DataLoader, LoaderOptions
from titan_lite.data.datasets import (
    BUNDLED_DATASETS,
    DocumentStream,
    StreamPosition,
    build_packed_source,
    encoded_documents,
)
from titan_lite.data.indexed import TokenWindows
from titan_lite.data.token_chunks import RecordEncoder
from titan_lite.data.token_files import open_token_folder
from titan_lite.data.token_writer import write_token_folder
from titan_lite.data.tokenizer import HFByteLevelBPETokenizer, SentencePieceTokenizer, build_tokenizer
from titan_lite.data.tokenizer.bpe_core import missing_bytes

# torchdata's StatefulDataLoader calls a deprecated torch function: its warning would land among the figures (train.py
# filters it the same way).
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
DEGREES = (1, 8, 64, 512)
LINE_CHARS = 3000
PARTS = ("tokenize", "rows", "loaders", "workers", "threads", "tokenizers", "smollm2")
REPO = Path(__file__).resolve().parents[1]
SMOLLM2_MISSING_BYTES = (4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256))
CORE, HF = "titan_lite tokenizer.json on tiktoken's core", "HF tokenizers"


def write_lines(folder: Path, copies: int = 1, limit: int | None = None) -> Path:
    """The bundled plays as JSON lines of LINE_CHARS characters (`copies` times over)."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(BUNDLED_DATASETS["shakespeare"].glob("*.txt"))]
    lines = [t[i:i + LINE_CHARS] for t in texts for i in range(0, len(t), LINE_CHARS)][:limit]
    path = folder / f"plays_x{copies}.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines * copies))
    return path


def train_tokenizer(folder: Path, vocab: int, lines: Path, missing: tuple[int, ...] = (),
                    more_texts: list[str] | None = None) -> Path:
    """A byte-level BPE in SmolLM2's structure trained with `tokenizers` (the benchmark's only use of it) on the
    lines (and `more_texts`), without the single bytes `missing` (which the texts do not hold)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # the oracle: benchmarks only

    from titan_lite.data.tokenizer import byte_level_alphabet

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in lines.read_text().splitlines()] + (more_texts or [])
    alphabet = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - {byte_level_alphabet()[b] for b in missing})
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=alphabet, show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>",
                                                              "eos_token": "<|endoftext|>"}))
    return folder


def loader_rates(make_source, degrees: tuple[int, ...], seq_len: int, seconds: float,
                 workers: int = 0) -> list[float]:
    """Tokens per second delivered to rank 0 of each of `degrees` ranks (local batch 1): a loader per degree, each
    first read a batch untimed (the epoch's plan, workers starting), then timed in spans of at least one batch and
    `seconds` / 3, the degrees taking turns for three rounds; the best span of each (the machine is shared: the best
    is the least disturbed, and turns spread a disturbance over the degrees alike)."""
    options = LoaderOptions(num_workers=workers, prefetch_factor=4 if workers else None)  # the trainer's start method
    loaders = [iter(DataLoader(make_source(), BatchLayout(1, 0, d), options)) for d in degrees]
    for batches in loaders:
        for _ in range(1 + 4 * workers):  # and what the workers prefetched meanwhile: no span starts from a full queue
            next(batches)
    best = [0.0] * len(degrees)
    for _ in range(3):
        for i, batches in enumerate(loaders):
            start, count = time.perf_counter(), 0
            while count == 0 or time.perf_counter() - start < seconds / 3:
                next(batches)
                count += 1
            best[i] = max(best[i], count * seq_len / (time.perf_counter() - start))
    return best


def tokenizer_rates(folder: Path, lines: Path, texts: list[str] | None = None) -> tuple[dict[str, float], str]:
    """Tokens per second of each tokenizer on the same documents (the lines', or `texts`), one thread (the best of
    three alternating rounds); and how many documents' ids equal `tokenizers`'."""
    import tiktoken
    from tokenizers import Tokenizer  # the oracle: benchmarks only

    texts = texts or [json.loads(line)["text"] for line in lines.read_text().splitlines()]
    core = build_tokenizer(str(folder))
    python = HFByteLevelBPETokenizer(folder / "tokenizer.json", core=False)
    oracle = Tokenizer.from_file(str(folder / "tokenizer.json"))
    oracle.encode_special_tokens = True
    plain = tiktoken.Encoding("plain", pat_str=core._core._pat_str, mergeable_ranks=core._core._mergeable_ranks,
                              special_tokens={})
    runs = {CORE: lambda t: core.encode(t, bos=False),
            "titan_lite tokenizer.json in Python": lambda t: python.encode(t, bos=False),
            HF: lambda t: oracle.encode(t, add_special_tokens=False).ids,
            "tiktoken (same ranks and pattern)": plain.encode_ordinary}
    if missing_bytes(plain._mergeable_ranks):  # tiktoken alone cannot encode a text holding one of them
        del runs["tiktoken (same ranks and pattern)"]
    rates = dict.fromkeys(runs, 0.0)
    for _ in range(3):  # alternately, the best of three (the machine is shared)
        for name, encode in runs.items():
            start = time.perf_counter()
            count = sum(len(encode(t)) for t in texts)
            rates[name] = max(rates[name], count / (time.perf_counter() - start))
    equal = sum(core.encode(t, bos=False) == oracle.encode(t, add_special_tokens=False).ids for t in texts)
    return rates, f"{equal:,} of {len(texts):,} documents ({count:,} tokens)"


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: every part runs, no meaningful figure")
    parser.add_argument("--seconds", type=float, default=3.0, help="time per loader figure (after one batch)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the figures to measure")
    opts = parser.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # `tokenizers` on one thread, as the others
    seq_len, degrees, vocab = (64, (1, 8), 500) if opts.smoke else (2048, DEGREES, 16_384)
    seconds = 0.2 if opts.smoke else opts.seconds
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = write_lines(tmp, limit=40 if opts.smoke else None)
        folder = train_tokenizer(tmp / "tokenizer", vocab, lines)
        print(f"data_loading: {lines.stat().st_size / 1e6:.1f} MB of JSON lines ({LINE_CHARS:,}-character plays); "
              f"tokenizer.json byte-level BPE of {vocab:,} tokens; seq_len {seq_len}", flush=True)
        parts = set(opts.parts)
        if "tokenize" in parts:
            run_tokenize(tmp, lines, folder, opts.smoke)
        if "rows" in parts:
            run_rows(tmp, opts.smoke)
        tokens = tmp / "tokens"
        if parts & {"loaders", "workers"}:
            write_token_folder(tokens, [str(lines)], RecordEncoder("text", build_tokenizer(str(folder))),
                               report=lambda line: None)
        if "loaders" in parts:
            run_loaders(lines, folder, tokens, seq_len, degrees, seconds)
        if "workers" in parts:
            run_workers(lines, folder, tokens, seq_len, seconds)
        if "threads" in parts:
            run_threads(tmp, lines, folder, vocab)
        if "tokenizers" in parts:
            rates, equal = tokenizer_rates(folder, lines)
            print("tokenizers on the same text, one thread: " + "; ".join(f"{k} {v:,.0f} tokens/s"
                                                                            for k, v in rates.items())
                  + f"; ids equal HF tokenizers' on {equal}", flush=True)
        if "smollm2" in parts:
            run_smollm2(tmp, lines, opts.smoke)


def run_smollm2(tmp: Path, lines: Path, smoke: bool) -> None:
    """The tokenizers on the plays with a SmolLM2-sized vocabulary lacking SmolLM2's 21 single bytes, one document in
    25 holding one of them (each such document goes to the Python BPE)."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:3 if smoke else None]
    more = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib]
    vocab = 600 if smoke else 49_152
    folder = train_tokenizer(tmp / "smollm2_style", vocab, lines, SMOLLM2_MISSING_BYTES, more)
    texts = [json.loads(line)["text"] for line in lines.read_text().splitlines()]
    odd = [chr(4), chr(6), chr(0x13), chr(0x14), chr(0x16), chr(0x1d), chr(0x40000), chr(0x8ABCD)]
    texts = [t[:100] + odd[i // 25 % len(odd)] + t[100:] if i % 25 == 0 else t for i, t in enumerate(texts)]
    lacking = missing_bytes(build_tokenizer(str(folder))._core._mergeable_ranks)
    assert lacking == list(SMOLLM2_MISSING_BYTES), f"the trained vocabulary lacks {lacking}"
    rates, equal = tokenizer_rates(folder, lines, texts)
    held = sum(any(ch in t for ch in odd) for t in texts)
    print(f"tokenizers with a SmolLM2-sized tokenizer.json ({vocab:,} tokens, without SmolLM2's 21 missing single "
          f"bytes; {held} of {len(texts)} documents hold one), one thread: "
          + "; ".join(f"{k} {v:,.0f} tokens/s" for k, v in rates.items())
          + f"; core / HF tokenizers {rates[CORE] / rates[HF]:.2f}x; ids equal HF tokenizers' on {equal}",
          flush=True)


def chat_rows(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Conversations of the plays' lines: a system turn, then one to four user/assistant exchanges (seeded)."""
    words = (REPO / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text().split()
    rng = random.Random(seed)

    def line() -> str:
        n = rng.randint(4, 60)
        start = rng.randrange(len(words) - n)
        return " ".join(words[start:start + n])

    rows = []
    for _ in range(count):
        turns = [{"role": "system", "content": line()}]
        for _ in range(rng.randint(1, 4)):
            turns += [{"role": "user", "content": line()}, {"role": "assistant", "content": line()}]
        rows.append(turns)
    return rows


def run_rows(tmp: Path, smoke: bool) -> None:
    """scripts/tokenize_data.py's writer (one process) on text, chat and preference rows with the same ChatML
    tokenizer: tokens/s of each (reading, rendering and writing included), the best of three alternating rounds."""
    chatml = tmp / "chatml"
    subprocess.run([sys.executable, str(REPO / "scripts/make_synthetic_chat.py"), "--output", str(tmp / "sc.jsonl"),
                    "--num_conversations", "1", "--tokenizer_output", str(chatml)], check=True,
                   stdout=subprocess.DEVNULL)
    rows = chat_rows(40 if smoke else 6000)
    chat, pairs = tmp / "chat.jsonl", tmp / "pairs.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    pairs.write_text("".join(json.dumps({"prompt": m[:-1], "chosen": [m[-1]],
                                         "rejected": [{"role": "assistant", "content": m[-3]["content"]}]}) + "\n"
                             for m in rows))
    text = write_lines(tmp, copies=1 if smoke else 4, limit=40 if smoke else None)
    tokenizer = build_tokenizer(str(chatml))
    settings = parse_config(["--instruct.chat_template", "tokenizer", "--preference.chat_template", "tokenizer"])
    encoders = {"text": (text, RecordEncoder("text", tokenizer)),
                "chat": (chat, RecordEncoder("chat", tokenizer, settings.instruct, chatml)),
                "preference": (pairs, RecordEncoder("preference", tokenizer, settings.preference, chatml))}
    rates, counts = dict.fromkeys(encoders, 0.0), {}
    for round_ in range(3):
        for kind, (path, encoder) in encoders.items():
            start = time.perf_counter()
            manifest = write_token_folder(tmp / f"rows_{kind}_{round_}", [str(path)], encoder,
                                          report=lambda line: None)
            rates[kind] = max(rates[kind], manifest["tokens"] / (time.perf_counter() - start))
            what = "documents" if kind == "text" else "rows"
            counts[kind] = f"{manifest['tokens']:,} tokens, {manifest['records']:,} {what}"
    print("tokenize_data.py, 1 process, the same ChatML tokenizer: " + "; ".join(
        f"{kind} {rates[kind]:,.0f} tokens/s ({counts[kind]})" for kind in encoders)
        + f"; text / chat {rates['text'] / rates['chat']:.2f}x, text / preference "
          f"{rates['text'] / rates['preference']:.2f}x (goal <= 4x)", flush=True)


def run_tokenize(tmp: Path, lines: Path, folder: Path, smoke: bool) -> None:
    """scripts/tokenize_data.py's writer on 1 and 2 processes (start-up included), on 32 copies of the text."""
    big = write_lines(tmp, copies=1 if smoke else 32, limit=40 if smoke else None)
    encoder = RecordEncoder("text", build_tokenizer(str(folder)))
    rates = {}
    for workers in (1, 2):
        start = time.perf_counter()
        manifest = write_token_folder(tmp / f"tokenized_{workers}", [str(big)], encoder, workers,
                                      chunk_chars=(big.stat().st_size // 16) or None, report=lambda line: None)
        rates[workers] = manifest["tokens"] / (time.perf_counter() - start)
    print(f"tokenize_data.py on {manifest['tokens']:,} tokens: 1 process {rates[1]:,.0f} tokens/s, 2 processes "
          f"{rates[2]:,.0f} tokens/s ({rates[2] / rates[1]:.2f}x; start-up included)", flush=True)


def loader_table(lines: Path, tokens: Path, tokenizers: dict, seq_len: int, degrees: tuple[int, ...],
                 seconds: float, report=print) -> dict[str, list[float]]:
    """One rank's tokens/s at each degree: raw text with each of `tokenizers` (name: tokenizer), and the token files
    (shuffled); each row reported as it is measured."""
    table = open_token_folder(tokens, "token files")
    sources = {f"raw text, {name}": (lambda t=tok: build_packed_source("jsonl", str(lines), t, seq_len))
               for name, tok in tokenizers.items()}
    sources["token files (shuffled)"] = lambda: TokenWindows("tokens", table, seq_len, shuffle=True)
    report(f"one rank's loader, tokens/s delivered to rank 0 of D ranks: {'':<30}"
           + "".join(f"{f'D = {d}':>12}" for d in degrees))
    figures = {}
    for name, source in sources.items():
        figures[name] = loader_rates(source, degrees, seq_len, seconds)
        report(f"  {name:<74}" + "".join(f"{r:>12,.0f}" for r in figures[name]))
    return figures


def run_loaders(lines: Path, folder: Path, tokens: Path, seq_len: int, degrees: tuple[int, ...],
                seconds: float) -> None:
    """The loader table with the tokenizer.json on tiktoken's core and in Python, and the token files' goals."""
    tokenizers = {"tokenizer.json on tiktoken's core": build_tokenizer(str(folder)),
                  "tokenizer.json in Python": HFByteLevelBPETokenizer(folder / "tokenizer.json", core=False)}
    figures = loader_table(lines, tokens, tokenizers, seq_len, degrees, seconds,
                           lambda line: print(line, flush=True))
    files = figures["token files (shuffled)"]
    print(f"token files at D = {degrees[-1]} / D = 1: {files[-1] / files[0]:.2f}x (goal >= 0.9x); "
          f"{files[-1]:,.0f} tokens/s per rank (goal > 1,000,000)", flush=True)


def run_workers(lines: Path, folder: Path, tokens: Path, seq_len: int, seconds: float) -> None:
    """At D = 8, num_workers 2 against 1: on token files (each worker reads only its own microbatches) and on raw
    text with the tokenizer.json on tiktoken's core (one worker reads the stream, the workers' threads encode)."""
    table, tokenizer = open_token_folder(tokens, "token files"), build_tokenizer(str(folder))
    sources = {"token files": lambda: TokenWindows("tokens", table, seq_len, shuffle=True),
               "raw text": lambda: build_packed_source("jsonl", str(lines), tokenizer, seq_len)}
    for name, source in sources.items():
        rates = {w: loader_rates(source, (8,), seq_len, seconds, workers=w)[0] for w in (1, 2)}
        print(f"DataLoader workers on {name} (D = 8): num_workers 1 {rates[1]:,.0f} tokens/s, 2 {rates[2]:,.0f} "
              f"tokens/s: {rates[2] / rates[1]:.2f}x (goal >= 1.7x)", flush=True)


def run_threads(tmp: Path, lines: Path, folder: Path, vocab: int) -> None:
    """Documents encoded side by side by 1 and 2 threads (encoded_documents, as a raw-text worker runs them), with
    each back end: the tokenizer.json on tiktoken's core and in Python, and a sentencepiece model trained on the
    same text; the best of three alternating rounds."""
    import sentencepiece  # a dependency (Llama 2's tokenizer.model)

    texts = [json.loads(line)["text"] for line in lines.read_text().splitlines()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp / "sp"),
                                             vocab_size=min(vocab, 4000), num_threads=1, minloglevel=2)
    encoders = {"tokenizer.json on tiktoken's core": build_tokenizer(str(folder)),
                "sentencepiece": SentencePieceTokenizer(sentencepiece.SentencePieceProcessor(str(tmp / "sp.model"))),
                "tokenizer.json in Python": HFByteLevelBPETokenizer(folder / "tokenizer.json", core=False)}
    stream = DocumentStream([lines])
    rates = {(name, threads): 0.0 for name in encoders for threads in (1, 2)}
    for _ in range(3):
        for name, threads in rates:
            encode = encoders[name].encode
            start = time.perf_counter()
            count = sum(len(ids) for ids, _ in encoded_documents(stream.read(StreamPosition()), encode, threads))
            rates[name, threads] = max(rates[name, threads], count / (time.perf_counter() - start))
    print("documents encoded by 1 and 2 threads: " + "; ".join(
        f"{name} {rates[name, 1]:,.0f} and {rates[name, 2]:,.0f} tokens/s ({rates[name, 2] / rates[name, 1]:.2f}x)"
        for name in encoders), flush=True)
    waits = {name: gil_wait(encoders[name], "".join(texts)) for name in list(encoders)[:2]}
    print("one encode call of the whole text, and the longest another Python thread waited during it (the GIL held "
          "throughout: the whole call): " + "; ".join(f"{name} {call * 1000:,.0f} ms, {wait * 1000:,.0f} ms"
                                                      for name, (call, wait) in waits.items()), flush=True)


def gil_wait(tokenizer, text: str) -> tuple[float, float]:
    """(seconds of one encode call, the longest gap between the steps of a Python thread spinning meanwhile): a
    library core that releases the GIL lets the spinner run throughout, on a loaded machine too."""
    stamps: list[float] = []
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    start = time.perf_counter()
    tokenizer.encode(text)
    end = time.perf_counter()
    done.set()
    spinner.join()
    inside = [t for t in stamps if start <= t <= end]
    return end - start, max(b - a for a, b in zip([start, *inside], [*inside, end], strict=True))


if __name__ == "__main__":
    sys.exit(main())
