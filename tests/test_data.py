"""Tests of the data pipeline: shard reading, packing, global batches sliced per rank, epochs and exact resume."""

import gzip
import itertools
import json
import logging
import pickle
import random
import time
from pathlib import Path

import pytest
import torch

from titan_lite.data.dataloader import BatchLayout, DataLoader, LoaderOptions, build_dataloader
from titan_lite.data.datasets import (
    DocumentStream,
    StreamPosition,
    build_packed_source,
    check_dataset,
    encoded_documents,
    known_datasets,
    resolve_shards,
)
from titan_lite.errors import ConfigError

BOS, EOS, OFFSET = 1, 2, 3


class ByteTokenizer:
    """Stand-in tokenizer: UTF-8 bytes shifted past the bos/eos ids."""

    bos_id, eos_id, vocab_size = BOS, EOS, 256 + OFFSET

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = [b + OFFSET for b in text.encode("utf-8")]
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8")


class ThreadedByteTokenizer(ByteTokenizer):
    """The stand-in, declared to encode without the GIL: raw-text workers share its encoding as threads."""

    backend, releases_gil = "bytes", True


TOK = ByteTokenizer()
DOCS = [f"doc {i}: " + "abcdefghij"[: i % 7 + 1] * (i % 3 + 1) for i in range(11)]


def write_jsonl(path: Path, texts: list[str], blank_after: int | None = None) -> Path:
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    if blank_after is not None:
        lines.insert(blank_after, "   ")
    data = ("\n".join(lines) + "\n").encode()
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


@pytest.fixture
def mixed_folder(tmp_path: Path) -> Path:
    """DOCS spread over a .jsonl, a .json.gz and two .txt shards, plus a file that is not a shard."""
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", DOCS[:4], blank_after=2)
    write_jsonl(folder / "b.json.gz", DOCS[4:9])
    (folder / "c.txt").write_text(DOCS[9], encoding="utf-8")
    (folder / "d.txt").write_text(DOCS[10], encoding="utf-8")
    (folder / "notes.md").write_text("not a shard")
    return folder


def all_texts(folder: Path) -> list[str]:
    stream = DocumentStream(resolve_shards("jsonl", str(folder)))
    return [text for text, _ in stream.read(StreamPosition())]


def token_stream(docs: list[str]) -> list[int]:
    return [t for d in docs for t in TOK.encode(d, bos=True, eos=True)]


def samples_of(source, n: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [sample for sample, _ in itertools.islice(source.samples(), n)]


def single(local_batch: int = 1) -> BatchLayout:
    return BatchLayout(local_batch, 0, 1)


# ---------------------------------------------------------------- reading sources


def test_folder_reads_jsonl_gzip_and_txt_shards_in_sorted_order(mixed_folder: Path):
    assert [p.name for p in resolve_shards("c4", str(mixed_folder))] == ["a.jsonl", "b.json.gz", "c.txt", "d.txt"]
    assert all_texts(mixed_folder) == DOCS


def test_single_file_paths(tmp_path: Path):
    gz = write_jsonl(tmp_path / "c4-train.00000-of-00001.json.gz", DOCS[:3])
    txt = tmp_path / "one.txt"
    txt.write_text("line one\nline two\n", encoding="utf-8")
    assert all_texts(gz) == DOCS[:3]
    assert all_texts(txt) == ["line one\nline two\n"]


def test_bundled_shakespeare_splits_are_disjoint_plays():
    train = resolve_shards("shakespeare", None)
    val = resolve_shards("shakespeare_validation", None)
    assert len(train) == 6 and len(val) == 1
    assert not {p.name for p in train} & {p.name for p in val}
    texts = [text for text, _ in DocumentStream(train).read(StreamPosition())]
    assert len(texts) == 6
    assert texts[0].startswith("ANTONY AND CLEOPATRA")
    assert not any("Gutenberg" in t for t in texts)
    assert 700_000 < sum(len(t) for t in texts) < 1_200_000


def test_bundled_shakespeare_loader_from_another_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    batch = next(iter(build_dataloader("shakespeare", None, TOK, 32, single(2))))
    inputs, labels = batch.inputs, batch.labels
    assert inputs.shape == labels.shape == (2, 32)
    assert inputs[0, 0].item() == BOS
    assert TOK.decode(inputs[0, 1:].tolist()).startswith("ANTONY AND CLEOP")


# ---------------------------------------------------------------- packing


def test_windows_concatenate_to_the_tokenized_documents(mixed_folder: Path):
    seq_len = 7
    samples = samples_of(build_packed_source("jsonl", str(mixed_folder), TOK, seq_len, infinite=False))
    expected = token_stream(DOCS)
    assert len(samples) == len(expected) // (seq_len + 1)
    for inputs, labels in samples:
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape == (seq_len,)
        assert torch.equal(inputs[1:], labels[:-1])
    windows = [torch.cat([x[:1], y]).tolist() for x, y in samples]
    assert sum(windows, []) == expected[: len(samples) * (seq_len + 1)]


def test_source_state_is_position_and_leftover_tokens(tmp_path: Path):
    path = write_jsonl(tmp_path / "big.jsonl", DOCS)
    source = build_packed_source("jsonl", str(path), TOK, 8)
    samples = source.samples()
    _, state = next(samples)
    consumed_docs = state["position"]["doc"]
    assert state["epoch"] == 0 and state["position"]["shard"] == 0
    assert state["position"]["line"] == consumed_docs
    consumed_lines = path.read_text().splitlines()[:consumed_docs]
    assert state["position"]["byte"] == len("".join(line + "\n" for line in consumed_lines))
    assert state["buffer"] == token_stream(DOCS[:consumed_docs])[9:]
    restarted = build_packed_source("jsonl", str(path), TOK, 8).samples(pickle.loads(pickle.dumps(state)))
    assert all(torch.equal(a, b) for a, b in zip(next(restarted)[0], next(samples)[0], strict=True))


def test_infinite_stream_repeats_documents_and_counts_epochs(mixed_folder: Path, caplog: pytest.LogCaptureFixture):
    seq_len = 10
    per_epoch = token_stream(DOCS)
    source = build_packed_source("jsonl", str(mixed_folder), TOK, seq_len, infinite=True)
    n = 3 * len(per_epoch) // (seq_len + 1) + 2  # well into the fourth epoch
    epochs, tokens = [], []
    with caplog.at_level(logging.INFO, logger="titan_lite.data.datasets"):
        for (inputs, labels), state in itertools.islice(source.samples(), n):
            epochs.append(state["epoch"])
            tokens += [inputs[0].item(), *labels.tolist()]
    assert tokens == (per_epoch * 4)[: n * (seq_len + 1)]
    assert epochs == [(k * (seq_len + 1) - 1) // len(per_epoch) for k in range(1, n + 1)]
    assert epochs[-1] == 3
    assert [r.getMessage() for r in caplog.records] == [f"Dataset jsonl: starting epoch {e}" for e in (1, 2, 3)]


# ---------------------------------------------------------------- global batches, sliced per rank

SEQ = 5
# (local batch, data-parallel degree, accumulation): all with a global batch of 4 sequences.
LAYOUTS = [(4, 1, 1), (2, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 2), (1, 4, 1)]


def microbatches(folder: Path, local: int, degree: int, accumulation: int, rank: int, steps: int,
                 num_workers: int = 0, state: dict | None = None):
    """`steps` global batches' microbatches of one rank, and the loader (to read its state)."""
    loader = build_dataloader("jsonl", str(folder), TOK, SEQ, BatchLayout(local, rank, degree, accumulation),
                              LoaderOptions(num_workers=num_workers, start_method="forkserver"))
    if state is not None:
        loader.load_state_dict(pickle.loads(pickle.dumps(state)))  # as a checkpoint would store it
    return list(itertools.islice(iter(loader), steps * accumulation)), loader


def global_batches(folder: Path, layout: tuple[int, int, int], steps: int, **kwargs) -> list[torch.Tensor]:
    """Every rank's microbatches of each step, put back together in the global order (microbatch, rank)."""
    local, degree, accumulation = layout
    per_rank = [microbatches(folder, local, degree, accumulation, r, steps, **kwargs)[0] for r in range(degree)]
    out = []
    for step in range(steps):
        rows = [per_rank[r][step * accumulation + a].inputs for a in range(accumulation) for r in range(degree)]
        out.append(torch.cat(rows))
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"L{lb}xD{d}xA{a}" for lb, d, a in LAYOUTS])
def test_a_global_batch_holds_the_same_sequences_on_every_layout(mixed_folder: Path, layout):
    steps = 12  # 48 windows of 6 tokens: over two epochs of the stream
    stream = [x for x, _ in samples_of(build_packed_source("jsonl", str(mixed_folder), TOK, SEQ), 4 * steps)]
    got = global_batches(mixed_folder, layout, steps)
    for step, batch in enumerate(got):
        assert torch.equal(batch, torch.stack(stream[4 * step:4 * step + 4])), step


def test_dataloader_workers_keep_the_order(mixed_folder: Path):
    plain, _ = microbatches(mixed_folder, 1, 2, 2, 1, steps=5)
    with_workers, _ = microbatches(mixed_folder, 1, 2, 2, 1, steps=5, num_workers=2)
    assert all(a.equal(b) for a, b in zip(plain, with_workers, strict=True))


def test_encoding_threads_hand_out_documents_in_order_and_a_bad_line_in_its_place(tmp_path: Path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS) + "not json\n")
    jitter = random.Random(0)

    def encode(text: str) -> list[int]:
        time.sleep(jitter.random() / 500)  # threads finish out of order
        return TOK.encode(text)

    got = []
    with pytest.raises(ConfigError, match=r"docs.jsonl:12: not valid JSON"):
        for ids, position in encoded_documents(DocumentStream([path]).read(StreamPosition()), encode, threads=3,
                                               task_chars=20):
            got.append((ids, position))
    assert got == [(TOK.encode(t), p) for t, (_, p) in zip(DOCS, DocumentStream([path]).read(StreamPosition()),
                                                               strict=False)]


def test_raw_text_workers_share_the_tokenizing_with_the_same_windows_documents_and_states(
        mixed_folder: Path, caplog: pytest.LogCaptureFixture):
    k, total, tok = 4, 9, ThreadedByteTokenizer()
    layout = BatchLayout(1, 1, 2, 2)  # rank 1 of 2, two microbatches a step

    def loader(num_workers: int) -> DataLoader:
        source = build_packed_source("jsonl", str(mixed_folder), tok, SEQ, documents=True)
        return DataLoader(source, layout, LoaderOptions(num_workers=num_workers, start_method="forkserver"))

    def steps(made: DataLoader) -> tuple[list, list]:
        batches, states = [], []
        for _, batch in zip(range(total * layout.accumulation), made, strict=False):
            batches.append(batch)
            if len(batches) % layout.accumulation == 0:
                states.append(made.state_dict())
        return batches, states

    reference, reference_states = steps(loader(0))
    assert reference[0].documents is not None  # inputs, labels, document ids
    with caplog.at_level(logging.INFO, logger="titan_lite.data.dataloader"):
        shared = loader(2)
    assert "one worker process reads raw text 'jsonl' once and 2 threads in it share the tokenizing" in caplog.text
    assert shared._read_from(None).num_workers == 1
    got, states = steps(shared)
    assert all(a.equal(b) for a, b in zip(got, reference, strict=True))
    assert states == reference_states  # read ahead, never in a state

    # resumed mid-stream (what the worker runs, here in this process): the uninterrupted stream's samples
    resumed = loader(2).dataset
    resumed.start_state, resumed.encoders = pickle.loads(pickle.dumps(states[k - 1]["source"])), 2
    rest = [sample for sample, _ in itertools.islice(resumed, (total - k) * layout.accumulation)]
    expected = [(b.inputs[0], b.labels[0], b.documents[0]) for b in reference[k * layout.accumulation:]]
    assert all(torch.equal(x, y) for a, b in zip(rest, expected, strict=True) for x, y in zip(a, b, strict=True))

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan_lite.data.dataloader"):
        DataLoader(build_packed_source("jsonl", str(mixed_folder), TOK, SEQ), layout, LoaderOptions(num_workers=2))
    assert "each of the 2 workers reads and tokenizes the whole raw-text stream (its tokenizer (ByteTokenizer) " \
           "holds Python's GIL" in caplog.text


@pytest.mark.parametrize("saved, resumed", [((2, 2, 1), (4, 1, 1)), ((1, 4, 1), (1, 2, 2)), ((4, 1, 1), (1, 4, 1))])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_on_another_layout_continues_with_the_next_global_batch(mixed_folder: Path, saved, resumed,
                                                                        num_workers: int):
    k, total = 3, 9
    reference = global_batches(mixed_folder, saved, total)
    local, degree, accumulation = saved
    states = [microbatches(mixed_folder, local, degree, accumulation, r, k, num_workers)[1].state_dict()
              for r in range(degree)]
    assert all(s == states[0] for s in states)  # the same position on every rank
    rest = global_batches(mixed_folder, resumed, total - k, state=states[0], num_workers=num_workers)
    for step, (a, b) in enumerate(zip(rest, reference[k:], strict=True)):
        assert torch.equal(a, b), step


def test_resume_with_another_global_batch_size_is_refused(mixed_folder: Path):
    _, loader = microbatches(mixed_folder, 2, 2, 1, 0, steps=1)
    other = build_dataloader("jsonl", str(mixed_folder), TOK, SEQ, BatchLayout(2, 0, 1, 1))
    message = one_line_error(other.load_state_dict, loader.state_dict())
    assert message.startswith("the checkpoint's data position is for global batches of 4 sequences, this run has 2")
    assert "'training.global_batch_size' to 4" in message


def test_finite_pass_drops_an_incomplete_global_batch_and_restarts(mixed_folder: Path):
    loader = build_dataloader("jsonl", str(mixed_folder), TOK, 9, BatchLayout(2, 1, 2), infinite=False)
    first = [torch.cat([b.inputs, b.labels]) for b in loader]
    loader.restart()
    second = [torch.cat([b.inputs, b.labels]) for b in loader]
    assert len(first) == len(second) == (len(token_stream(DOCS)) // 10) // 4
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


# ---------------------------------------------------------------- user errors


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["c4", "c4_test", "c4_validation", "jsonl", "text"])
def test_local_dataset_without_path_says_local_shards_only(name: str):
    message = one_line_error(check_dataset, name, None)
    assert f"dataset '{name}'" in message
    assert "local shards only" in message and "set training.dataset_path" in message
    assert "validation.dataset_path" in one_line_error(build_dataloader, name, None, TOK, 8, single(),
                                                       key_prefix="validation")


def test_unknown_dataset_lists_known_names():
    message = one_line_error(check_dataset, "c5", None)
    assert "'training.dataset' = 'c5' is unknown" in message
    assert message.endswith("known datasets: " + ", ".join([*known_datasets(), "instruct", "preference", "prompts"]))
    assert known_datasets() == ["c4", "c4_test", "c4_validation", "jsonl", "shakespeare",
                                "shakespeare_validation", "text"]


def test_missing_or_empty_paths(tmp_path: Path):
    assert "'validation.dataset_path' = " in one_line_error(check_dataset, "c4", str(tmp_path / "nope"), "validation")
    assert "does not exist" in one_line_error(check_dataset, "c4", str(tmp_path / "nope"))
    assert "holds no .txt, .jsonl, .json.gz, .parquet files" in one_line_error(check_dataset, "c4", str(tmp_path))
    (tmp_path / "data.csv").write_text("a,b")
    assert "must end in one of" in one_line_error(check_dataset, "text", str(tmp_path / "data.csv"))
    check_dataset("shakespeare", None)
    check_dataset("c4", str(write_jsonl(tmp_path / "ok.jsonl", DOCS)))


@pytest.mark.parametrize("bad_line, problem", [("{not json", "not valid JSON"),
                                                ('{"content": "x"}', 'no "text" string'),
                                                ('["text"]', 'no "text" string')])
def test_bad_json_line_names_file_and_line(tmp_path: Path, bad_line: str, problem: str):
    path = tmp_path / "shard.json.gz"
    path.write_bytes(gzip.compress(f'{{"text": "fine"}}\n\n{bad_line}\n'.encode()))
    source = build_packed_source("c4", str(path), TOK, 4, infinite=False)
    message = one_line_error(samples_of, source)
    assert message.startswith(f"{path}:3: {problem}")


def test_empty_dataset_is_an_error(tmp_path: Path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    assert "dataset 'jsonl' has no documents" in one_line_error(samples_of, build_packed_source(
        "jsonl", str(path), TOK, 4), 1)


def test_parquet_shards_read_the_text_column_resumably(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq  # optional: only .parquet shards need it

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["first doc", "second doc", "third doc"], "id": [1, 2, 3]}), path)
    stream = DocumentStream(resolve_shards("text", str(path)))
    read = list(stream.read(StreamPosition()))
    assert [text for text, _ in read] == ["first doc", "second doc", "third doc"]
    assert [text for text, _ in stream.read(read[0][1])] == ["second doc", "third doc"]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    assert "no 'text' column" in one_line_error(lambda: list(DocumentStream([tmp_path / "bad.parquet"]).read(
        StreamPosition())))
