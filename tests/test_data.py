"""Tests of the data pipeline: shard reading, rank splitting, packing, epochs and exact resume."""

import gzip
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch

from titan_lite.errors import ConfigError
from titan_lite.data.dataloader import build_dataloader, check_dataset
from titan_lite.data.datasets import (
    DocumentStream,
    StreamPosition,
    build_packed_dataset,
    known_datasets,
    resolve_shards,
)

BOS, EOS, OFFSET = 1, 2, 3


class ByteTokenizer:
    """Stand-in tokenizer: UTF-8 bytes shifted past the bos/eos ids."""

    bos_id, eos_id, vocab_size = BOS, EOS, 256 + OFFSET

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = [b + OFFSET for b in text.encode("utf-8")]
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8")


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


def all_texts(folder: Path, rank: int = 0, world: int = 1) -> list[str]:
    stream = DocumentStream(resolve_shards("jsonl", str(folder)))
    return [text for text, _ in stream.read(StreamPosition(), rank, world)]


def token_stream(docs: list[str]) -> list[int]:
    return [t for d in docs for t in TOK.encode(d, bos=True, eos=True)]


def samples_of(dataset, n: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for sample in dataset:
        out.append(sample)
        if n is not None and len(out) == n:
            break
    return out


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
    texts = [text for text, _ in DocumentStream(train).read(StreamPosition(), 0, 1)]
    assert len(texts) == 6
    assert texts[0].startswith("ANTONY AND CLEOPATRA")
    assert not any("Gutenberg" in t for t in texts)
    assert 700_000 < sum(len(t) for t in texts) < 1_200_000


def test_bundled_shakespeare_loader_from_another_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    inputs, labels = next(iter(build_dataloader("shakespeare", None, TOK, 32, 2, 0, 1)))
    assert inputs.shape == labels.shape == (2, 32)
    assert inputs[0, 0].item() == BOS
    assert TOK.decode(inputs[0, 1:].tolist()).startswith("ANTONY AND CLEOP")


# ---------------------------------------------------------------- splitting across ranks


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_take_every_world_th_document_without_overlap(mixed_folder: Path, world: int):
    per_rank = [all_texts(mixed_folder, rank, world) for rank in range(world)]
    for rank, texts in enumerate(per_rank):
        assert texts == DOCS[rank::world]
    assert sorted(t for texts in per_rank for t in texts) == sorted(DOCS)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_packs_only_its_documents(mixed_folder: Path, world: int):
    seq_len = 5
    for rank in range(world):
        loader = build_dataloader("jsonl", str(mixed_folder), TOK, seq_len, 1, rank, world, infinite=False)
        windows = [torch.cat([x[0, :1], y[0]]).tolist() for x, y in loader]
        expected = token_stream(DOCS[rank::world])
        usable = len(expected) // (seq_len + 1) * (seq_len + 1)
        assert sum(windows, []) == expected[:usable]


# ---------------------------------------------------------------- packing


def test_windows_concatenate_to_the_tokenized_documents(mixed_folder: Path):
    seq_len = 7
    samples = samples_of(build_packed_dataset("jsonl", str(mixed_folder), TOK, seq_len, 0, 1, infinite=False))
    expected = token_stream(DOCS)
    assert len(samples) == len(expected) // (seq_len + 1)
    for inputs, labels in samples:
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape == (seq_len,)
        assert torch.equal(inputs[1:], labels[:-1])
    windows = [torch.cat([x[:1], y]).tolist() for x, y in samples]
    assert sum(windows, []) == expected[: len(samples) * (seq_len + 1)]


def test_loader_batches_are_long_tensors_of_batch_by_seq_len(mixed_folder: Path):
    batches = list(build_dataloader("jsonl", str(mixed_folder), TOK, 6, 3, 0, 1, infinite=False))
    samples = len(token_stream(DOCS)) // 7
    assert [b[0].shape[0] for b in batches] == [3] * (samples // 3) + ([samples % 3] if samples % 3 else [])
    assert all(x.dtype == y.dtype == torch.int64 and x.shape[1] == y.shape[1] == 6 for x, y in batches)


def test_finite_pass_stops_and_next_iteration_starts_over(mixed_folder: Path):
    loader = build_dataloader("jsonl", str(mixed_folder), TOK, 9, 2, 0, 1, infinite=False)
    first, second = [torch.cat(b) for b in loader], [torch.cat(b) for b in loader]
    assert len(first) == len(second) == -(-(len(token_stream(DOCS)) // 10) // 2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------- epochs


def test_infinite_stream_repeats_documents_and_counts_epochs(mixed_folder: Path, caplog: pytest.LogCaptureFixture):
    seq_len = 10
    per_epoch = token_stream(DOCS)
    dataset = build_packed_dataset("jsonl", str(mixed_folder), TOK, seq_len, 0, 1, infinite=True)
    n = 3 * len(per_epoch) // (seq_len + 1) + 2  # well into the fourth epoch
    epochs, tokens = [], []
    with caplog.at_level(logging.INFO, logger="titan_lite.data.datasets"):
        iterator = iter(dataset)
        for _ in range(n):
            inputs, labels = next(iterator)
            epochs.append(dataset.epoch)
            tokens += [inputs[0].item(), *labels.tolist()]
    assert tokens == (per_epoch * 4)[: n * (seq_len + 1)]
    assert epochs == [(k * (seq_len + 1) - 1) // len(per_epoch) for k in range(1, n + 1)]
    assert epochs[-1] == 3
    assert [r.getMessage() for r in caplog.records] == [f"Dataset jsonl: starting epoch {e}" for e in (1, 2, 3)]


# ---------------------------------------------------------------- exact resume


def take(iterator, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_resume_yields_exactly_the_next_batches(mixed_folder: Path, num_workers: int, k: int):
    def loader():
        return build_dataloader("jsonl", str(mixed_folder), TOK, 11, 2, 1, 2, num_workers=num_workers)

    total = 16  # rank 1 has 76 tokens an epoch, so 384 tokens cross about five epoch boundaries
    reference = take(iter(loader()), total)

    first = loader()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(take(iter(first), k), reference))
    state = pickle.loads(pickle.dumps(first.state_dict()))  # as a checkpoint would store it

    resumed = loader()
    resumed.load_state_dict(state)
    rest = take(iter(resumed), total - k)
    for (x, y), (x_ref, y_ref) in zip(rest, reference[k:]):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_dataset_state_is_position_and_leftover_tokens(tmp_path: Path):
    path = write_jsonl(tmp_path / "big.jsonl", DOCS)
    dataset = build_packed_dataset("jsonl", str(path), TOK, 8, 0, 1)
    iterator = iter(dataset)
    next(iterator)
    state = dataset.state_dict()
    consumed_docs = state["position"]["doc"]
    assert state["epoch"] == 0 and state["position"]["shard"] == 0
    assert state["position"]["line"] == consumed_docs
    assert state["position"]["byte"] == len("".join(line + "\n" for line in path.read_text().splitlines()[:consumed_docs]))
    assert state["buffer"] == token_stream(DOCS[:consumed_docs])[9:]

    restored = build_packed_dataset("jsonl", str(path), TOK, 8, 0, 1)
    restored.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(next(iter(restored)), next(iterator)))


def test_resume_with_a_different_split_is_refused(mixed_folder: Path):
    dataset = build_packed_dataset("jsonl", str(mixed_folder), TOK, 8, 0, 2)
    other = build_packed_dataset("jsonl", str(mixed_folder), TOK, 8, 0, 4)
    with pytest.raises(ConfigError, match="split 2 ways.*now 4"):
        other.load_state_dict(dataset.state_dict())


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
    assert "validation.dataset_path" in one_line_error(build_dataloader, name, None, TOK, 8, 1, 0, 1,
                                                       key_prefix="validation")


def test_unknown_dataset_lists_known_names():
    message = one_line_error(check_dataset, "c5", None)
    assert "'training.dataset' = 'c5' is unknown" in message
    assert message.endswith("known datasets: " + ", ".join(known_datasets()))
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
    dataset = build_packed_dataset("c4", str(path), TOK, 4, 0, 1, infinite=False)
    message = one_line_error(samples_of, dataset)
    assert message.startswith(f"{path}:3: {problem}")


def test_bad_line_of_another_rank_is_not_parsed_here(tmp_path: Path):
    path = tmp_path / "shard.jsonl"
    path.write_text('{"text": "mine"}\nBROKEN\n{"text": "mine too"}\n')
    assert all_texts(path, rank=0, world=2) == ["mine", "mine too"]
    assert "shard.jsonl:2: not valid JSON" in one_line_error(all_texts, path, rank=1, world=2)


def test_loader_option_errors(mixed_folder: Path):
    path = str(mixed_folder)
    assert "'training.dataloader.prefetch_factor' = 2 needs" in one_line_error(
        build_dataloader, "jsonl", path, TOK, 8, 1, 0, 1, prefetch_factor=2)
    assert "'training.local_batch_size' must be at least 1" in one_line_error(
        build_dataloader, "jsonl", path, TOK, 8, 0, 0, 1)
    assert "rank 2 is outside 0..1" in one_line_error(build_dataloader, "jsonl", path, TOK, 8, 1, 2, 2)


def test_more_splits_than_documents_is_an_error(tmp_path: Path):
    path = write_jsonl(tmp_path / "two.jsonl", DOCS[:2])
    dataset = build_packed_dataset("jsonl", str(path), TOK, 4, 2, 3)
    assert "no documents for data split 2 of 3" in one_line_error(samples_of, dataset, 1)


def test_parquet_shards_read_the_text_column_resumably(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["first doc", "second doc", "third doc"], "id": [1, 2, 3]}), path)
    stream = DocumentStream(resolve_shards("text", str(path)))
    read = list(stream.read(StreamPosition(), 0, 1))
    assert [text for text, _ in read] == ["first doc", "second doc", "third doc"]
    assert [text for text, _ in stream.read(read[0][1], 0, 1)] == ["second doc", "third doc"]
    assert [text for text, _ in stream.read(StreamPosition(), 1, 2)] == ["second doc"]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    assert "no 'text' column" in one_line_error(lambda: list(DocumentStream([tmp_path / "bad.parquet"]).read(
        StreamPosition(), 0, 1)))
