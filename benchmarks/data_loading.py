"""Data at scale: one rank's loader tokens/s at data-parallel degrees 1, 8, 64 and 512 (rank 0's loader built with
that degree, local batch 1), raw text (tokenized by every rank) against token files (each rank reads its own); two
DataLoader workers against one, on token files and on raw text (where the workers' threads share the tokenizing);
documents encoded by 1 and 2 threads with each tokenizer back end (and whether the library cores release the GIL);
scripts/tokenize_data.py's tokens/s against its number of processes; and the tokenizer on the same text:
titan_lite's tokenizer.json BPE on tiktoken's core and in Python, HF `tokenizers` and a plain tiktoken encoding of
the same ranks and pattern.

    .venv/bin/python -m benchmarks.data_loading            # every figure (a few minutes on 2 busy cores)
    .venv/bin/python -m benchmarks.data_loading --smoke    # tiny sizes: checks that every part runs (seconds)

The text is the bundled Shakespeare plays as JSON lines of 3,000 characters; the tokenizer.json is a byte-level BPE
trained with `tokenizers` on them in SmolLM2's structure (Digits then ByteLevel, 16,384 tokens).
"""

import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from benchmarks import cli
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

# torchdata's StatefulDataLoader calls a deprecated torch function: its warning would land among the figures (train.py
# filters it the same way).
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
DEGREES = (1, 8, 64, 512)
LINE_CHARS = 3000


def write_lines(folder: Path, copies: int = 1, limit: int | None = None) -> Path:
    """The bundled plays as JSON lines of LINE_CHARS characters (`copies` times over)."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(BUNDLED_DATASETS["shakespeare"].glob("*.txt"))]
    lines = [t[i:i + LINE_CHARS] for t in texts for i in range(0, len(t), LINE_CHARS)][:limit]
    path = folder / f"plays_x{copies}.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines * copies))
    return path


def train_tokenizer(folder: Path, vocab: int, lines: Path) -> Path:
    """A byte-level BPE in SmolLM2's structure trained with `tokenizers` (the benchmark's only use of it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # the oracle: benchmarks only

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in lines.read_text().splitlines()]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
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


def tokenizer_rates(folder: Path, lines: Path) -> tuple[dict[str, float], str]:
    """Tokens per second of each tokenizer on the same documents, one thread (the best of three alternating rounds);
    and how many documents' ids equal `tokenizers`'."""
    import tiktoken
    from tokenizers import Tokenizer  # the oracle: benchmarks only

    texts = [json.loads(line)["text"] for line in lines.read_text().splitlines()]
    core = build_tokenizer(str(folder))
    python = HFByteLevelBPETokenizer(folder / "tokenizer.json", core=False)
    oracle = Tokenizer.from_file(str(folder / "tokenizer.json"))
    oracle.encode_special_tokens = True
    plain = tiktoken.Encoding("plain", pat_str=core._core._pat_str, mergeable_ranks=core._core._mergeable_ranks,
                              special_tokens={})
    runs = {"titan_lite tokenizer.json on tiktoken's core": lambda t: core.encode(t, bos=False),
            "titan_lite tokenizer.json in Python": lambda t: python.encode(t, bos=False),
            "HF tokenizers": lambda t: oracle.encode(t, add_special_tokens=False).ids,
            "tiktoken (same ranks and pattern)": plain.encode_ordinary}
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
        run_tokenize(tmp, lines, folder, opts.smoke)
        tokens = tmp / "tokens"
        write_token_folder(tokens, [str(lines)], RecordEncoder("text", build_tokenizer(str(folder))),
                           report=lambda line: None)
        run_loaders(lines, folder, tokens, seq_len, degrees, seconds)
        run_workers(lines, folder, tokens, seq_len, seconds)
        run_threads(tmp, lines, folder, vocab)
        rates, equal = tokenizer_rates(folder, lines)
        print("tokenizers on the same text, one thread: " + "; ".join(f"{k} {v:,.0f} tokens/s"
                                                                        for k, v in rates.items())
              + f"; ids equal HF tokenizers' on {equal}", flush=True)


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
