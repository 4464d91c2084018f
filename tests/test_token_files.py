"""Token files: the writer and scripts/tokenize_data.py (every input kind, workers, progress, resume), what training
reads from them (by index, only each rank's and worker's samples, the raw text's windows when in order, seeded
shuffling), and every bad input as one line."""

import gzip
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import benchmarks.figures as readme_figures
from titan_lite.config import parse_args, validate
from titan_lite.config.schema import DataMixture
from titan_lite.data import token_chunks
from titan_lite.data.chat import ChatEncoder, load_chat_template
from titan_lite.data.dataloader import BatchLayout, GlobalBatchSlices, build_section_source
from titan_lite.data.datasets import (
    BUNDLED_DATASETS,
    Deferred,
    DocumentStream,
    StreamPosition,
    build_packed_source,
    shards_at,
)
from titan_lite.data.indexed import TokenWindows
from titan_lite.data.instruct import PAD_DOCUMENT, InstructFormat, InstructionFile
from titan_lite.data.mixture import build_domain_weights
from titan_lite.data.order import GlobalOrder, Permutation
from titan_lite.data.preference import PairEncoder, PreferenceFile
from titan_lite.data.token_files import MANIFEST, OFFSETS, open_token_folder, shard_file
from titan_lite.data.token_writer import RecordEncoder, write_token_folder
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.errors import ConfigError
from titan_lite.folders import partial_folder
from titan_lite.job.plan import check_before_launch, check_section_data

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "assets" / "tokenizer"
PLAY = BUNDLED_DATASETS["shakespeare"] / "julius_caesar.txt"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOKENIZE = load_script("tokenize_data")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(str(TOKENIZER))


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """The CPU chat example's tokenizer folder (the bundled BPE as a ChatML tokenizer.json with its template)."""
    return load_script("make_synthetic_chat").chat_tokenizer_folder(tmp_path_factory.mktemp("chat") / "tokenizer")


def text_shards(folder: Path) -> Path:
    """A folder of every raw-text format training.dataset_path reads: .txt, .jsonl, .json.gz and .parquet."""
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    text = PLAY.read_text(encoding="utf-8")
    folder.mkdir(parents=True)
    (folder / "a.txt").write_text(text[:3000])
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": text[i:i + 700]}) + "\n"
                                            for i in range(3000, 10000, 700)))
    with gzip.open(folder / "c.json.gz", "wt") as f:
        f.write("".join(json.dumps({"text": text[i:i + 500]}) + "\n" for i in range(10000, 13000, 500)))
    pq.write_table(pa.table({"text": [text[i:i + 900] for i in range(13000, 16000, 900)]}), folder / "d.parquet")
    return folder


def one_line(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


def train_config(path: Path, *extra: str, tokenizer: Path = TOKENIZER):
    cfg = parse_args(["--job.config_file", str(ROOT / "tests/integration/base.toml"), "--training.dataset", "text",
                      "--training.dataset_path", str(path), "--model.hf_assets_path", str(tokenizer),
                      "--training.seq_len", "32", *extra])
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- writing


def test_text_token_files_hold_every_document_as_packing_reads_it(tmp_path, tok):
    shards = text_shards(tmp_path / "raw")
    manifest = write_token_folder(tmp_path / "tokens", [str(shards)], RecordEncoder("text", tok), chunk_chars=4000,
                                  report=lambda line: None)
    table = open_token_folder(tmp_path / "tokens", "training.dataset_path")
    texts = [text for text, _ in DocumentStream(shards_at(shards, "k")).read(StreamPosition())]
    assert table.num_documents == len(texts) == manifest["documents"] and len(manifest["shards"]) >= 3
    for d, text in enumerate(texts):
        assert table.document(d)[0].tolist() == tok.encode(text, bos=True, eos=True)
    assert (manifest["format"], manifest["version"], manifest["kind"], manifest["dtype"]) == \
        ("titan_lite token files", 1, "text", "uint16")
    assert manifest["tokens"] == table.num_tokens == sum(len(tok.encode(t, bos=True, eos=True)) for t in texts)
    assert manifest["sources"][0]["bytes"] == sum(p.stat().st_size for p in shards.iterdir())
    assert manifest["tokenizer"]["vocab_size"] == 2048 and len(manifest["tokenizer"]["sha256"]) == 64
    assert not partial_folder(tmp_path / "tokens").exists()


def conversations(count: int) -> list[dict]:
    rng = random.Random(0)
    return [{"messages": [{"role": "user", "content": f"What is {i} + {rng.randint(1, 9)}?"},
                          {"role": "assistant", "content": f"It is {i}.\n#### {i}"}]} for i in range(count)]


def test_chat_instruct_and_preference_rows_hold_their_ids_and_masks(tmp_path, chat_tokenizer):
    chat_rows, tok = tmp_path / "chat.jsonl", build_tokenizer(str(chat_tokenizer))
    chat_rows.write_text("".join(json.dumps(r) + "\n" for r in conversations(12)))
    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps({"question": f"{i} + 1 =", "answer": f" {i + 1}"}) + "\n"
                                for i in range(9)))
    pairs = tmp_path / "pairs.jsonl"
    pair_rows = [{"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i + 2}"} for i in range(6)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in [*pair_rows, {"prompt": "x", "chosen": " y",
                                                                          "rejected": " y"}]))
    for kind, data, extra in (("chat", chat_rows, []), ("instruct", examples, ["--instruct.template", "Q: {prompt}"]),
                              ("preference", pairs, [])):
        assert TOKENIZE.main(["--hf_assets_path", str(chat_tokenizer), "--kind", kind, "--data", str(data),
                              "--output_dir", str(tmp_path / kind), *extra]) == 0
    cfg = parse_args(["--instruct.template", "Q: {prompt}"])
    chat = InstructFormat(cfg.instruct, tok, ChatEncoder(load_chat_template("tokenizer", chat_tokenizer, tok), tok))
    for kind, fmt, data in (("chat", chat, chat_rows), ("instruct", InstructFormat(cfg.instruct, tok), examples)):
        table = open_token_folder(tmp_path / kind, "k")
        records = list(InstructionFile(data, cfg.instruct, "k").examples())
        assert table.num_documents == len(records) and table.records["rows"].tolist() == list(range(len(records)))
        for d, (_, record) in enumerate(records):
            ids, mask = table.document(d)
            assert (ids.tolist(), mask.tolist()) == fmt.encode(record)
        assert table.manifest["settings"]["chat_template"] == ("tokenizer" if kind == "chat" else None)
    table, encoder = open_token_folder(tmp_path / "preference", "k"), PairEncoder(tok, None)
    assert table.num_documents == 2 * 7 and table.records["problems"].tolist() == [0] * 6 + [1]
    for k, (_, pair) in enumerate(list(PreferenceFile(pairs, cfg.preference, "k").examples())[:6]):
        encoded = encoder.encode(pair)
        assert table.records["prompt_lengths"][k] == len(encoded.prompt)
        for answer, (ids, mask) in enumerate(encoded.documents()):
            assert [a.tolist() for a in table.document(2 * k + answer)] == [ids, mask]


def test_tokenize_script_workers_progress_a_resumed_interruption_and_refusals(tmp_path, capsys, monkeypatch):
    shards = text_shards(tmp_path / "raw")
    args = ["--hf_assets_path", str(TOKENIZER), "--data", str(shards), "--chunk_mb", "0.004"]
    assert TOKENIZE.main([*args, "--output_dir", str(tmp_path / "whole"), "--workers", "2"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0].endswith("(text) with '" + str(TOKENIZER) + "' (tiktoken), 2 process(es)")
    assert any(line.startswith("tokenized ") and "tokens/s, ETA" in line for line in printed[1:-1])
    assert printed[-1].startswith(f"wrote {tmp_path / 'whole'}: ") and "uint16, 4 shard(s)" in printed[-1]
    assert (tmp_path / "whole" / "titan_lite_output.json").is_file()

    real = token_chunks.tokenize_chunk

    def interrupted(folder, chunk, dtype):
        if chunk.index == 2:
            raise KeyboardInterrupt
        return real(folder, chunk, dtype)

    monkeypatch.setattr(token_chunks, "tokenize_chunk", interrupted)
    out = tmp_path / "tokens"
    assert TOKENIZE.main([*args, "--output_dir", str(out)]) == 130
    assert capsys.readouterr().err.strip() == (f"error: interrupted (Ctrl-C); the finished chunks stay in "
                                               f"'{partial_folder(out)}': run the same command again to resume")
    assert not out.exists()
    assert one_line(train_config, out) == (
        f"'training.dataset_path' = '{out}' does not exist (an interrupted scripts/tokenize_data.py run left "
        f"'{partial_folder(out)}': run the same command again to finish it)")
    assert one_line(check_section_data, train_config(partial_folder(out)), "training") == (
        f"'training.dataset_path' = '{partial_folder(out)}' is the partial folder of an interrupted "
        "scripts/tokenize_data.py run (2 chunk(s) finished): run the same command again to finish it (it resumes "
        "from them), then point this key at its --output_dir")
    monkeypatch.setattr(token_chunks, "tokenize_chunk", real)
    assert TOKENIZE.main([*args, "--output_dir", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == \
        f"resuming the interrupted run in '{partial_folder(out)}': 2 chunk(s) done"
    for name in [MANIFEST, OFFSETS, *(shard_file(i) for i in range(4))]:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    assert TOKENIZE.main([*args, "--output_dir", str(foreign)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --output_dir '{foreign}' is not empty (notes.txt) and was not written by titan_lite (no "
        "titan_lite_output.json): name a new or empty folder; nothing there was changed")
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def tokenize_error(argv: list[str], capsys, code: int = 2) -> str:
    """The one line tokenize_data.py prints to stderr (without 'error: ') when it refuses `argv`."""
    assert TOKENIZE.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    return err.removeprefix("error: ")


def test_damaged_text_inputs_are_one_line_naming_the_file(tmp_path, capsys):
    """A truncated .json.gz (EOFError), a .json.gz that is not gzip, a file that is not parquet: one line each, from
    tokenize_data.py and from training on the raw files."""
    pytest.importorskip("pyarrow")
    lines = "".join(json.dumps({"text": f"line {i} " * 40}) + "\n" for i in range(2000)).encode()
    packed = gzip.compress(lines)
    truncated, plain, fake = tmp_path / "cut.json.gz", tmp_path / "plain.json.gz", tmp_path / "fake.parquet"
    truncated.write_bytes(packed[:len(packed) // 2])
    plain.write_bytes(lines[:500])
    fake.write_bytes(b"not parquet" * 20)
    args = ["--hf_assets_path", str(TOKENIZER), "--output_dir", str(tmp_path / "out"), "--data"]
    cut = tokenize_error([*args, str(truncated)], capsys)
    assert cut.startswith(f"{truncated}: after line ") and cut.endswith(
        " the file ends in the middle of its compressed data (a truncated download?); download or compress it again")
    assert tokenize_error([*args, str(plain)], capsys) == (
        f"{plain}: the file cannot be decompressed (Not a gzipped file (b'{{\"')); download or compress it again")
    assert tokenize_error([*args, str(fake)], capsys).startswith(f"{fake}: not a readable parquet file (")
    assert one_line(lambda: list(DocumentStream([truncated]).read(StreamPosition()))) == cut
    assert one_line(check_section_data, train_config(fake), "training").startswith(
        f"{fake}: not a readable parquet file (")


def test_tokenize_refuses_or_says_what_it_would_do_silently(tmp_path, capsys, monkeypatch):
    """An empty .txt, empty documents, a negative --chunk_mb, a file named twice, SIGTERM."""
    import os
    import signal

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    args = ["--hf_assets_path", str(TOKENIZER), "--output_dir", str(out)]
    assert tokenize_error([*args, "--data", str(empty)], capsys) == (
        f"--data '{empty}' holds no text: its 1 document(s) are all empty")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Friends, Romans", "", "  ", "countrymen"]))
    assert TOKENIZE.main([*args, "--data", str(rows)]) == 0
    assert "note: 2 of the 4 documents are empty (blank); each is kept as bos + eos, as training on the raw files " \
           "reads it" in capsys.readouterr().out.splitlines()
    assert tokenize_error([*args, "--data", str(rows), "--chunk_mb", "-1"], capsys) == (
        "--chunk_mb must be 0 (chosen from the data's size) or more, got -1.0")
    assert tokenize_error([*args, "--data", str(rows), str(rows)], capsys) == (
        f"--data names '{rows}' twice: it would be tokenized twice; name each input once")
    assert tokenize_error([*args, "--data", str(tmp_path), str(rows)], capsys) == (
        f"--data names '{rows}' twice (through '{tmp_path}' and '{rows}'): it would be tokenized twice; name each "
        "input once")
    real = token_chunks.tokenize_chunk

    def killed(folder, chunk, dtype):
        if chunk.index == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(folder, chunk, dtype)

    monkeypatch.setattr(token_chunks, "tokenize_chunk", killed)
    shards = text_shards(tmp_path / "raw")
    stopped = tmp_path / "stopped"
    assert tokenize_error(["--hf_assets_path", str(TOKENIZER), "--output_dir", str(stopped), "--data", str(shards),
                           "--chunk_mb", "0.004"], capsys, code=143) == (
        f"stopped (SIGTERM); the finished chunks stay in '{partial_folder(stopped)}': run the same command again "
        "to resume")
    assert signal.getsignal(signal.SIGTERM) is not TOKENIZE._terminated


def test_progress_counts_a_json_gz_uncompressed_and_starts_before_the_first_chunk_ends(tmp_path, capsys,
                                                                                        monkeypatch):
    text = PLAY.read_text(encoding="utf-8")
    lines = "".join(json.dumps({"text": text[i:i + 400]}) + "\n" for i in range(0, 40_000, 400)).encode()
    data = tmp_path / "play.json.gz"
    data.write_bytes(gzip.compress(lines))
    monkeypatch.setattr(token_chunks.Tally, "EVERY", 0.0)
    assert TOKENIZE.main(["--hf_assets_path", str(TOKENIZER), "--output_dir", str(tmp_path / "out"), "--data",
                          str(data)]) == 0
    printed = capsys.readouterr().out.splitlines()
    progress = [line for line in printed if line.startswith("tokenized ")]
    assert progress and all(f" of {len(lines) / 1e6:,.1f} MB of input), " in line for line in progress)
    first = int(progress[0].split(" MB of input), ")[1].split(" tokens")[0].replace(",", ""))
    total = json.loads((tmp_path / "out" / MANIFEST).read_text())["tokens"]
    assert 0 < first < total  # one chunk: the first line came from inside it

def test_a_refused_tokenize_run_leaves_no_partial_folder(tmp_path, capsys, monkeypatch):
    """Issue 59 item 7: refused inputs leave nothing half-written; a folder that may not be replaced at the end
    keeps the finished one, named."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "hello"}\n{"txt": "x"}\n')
    for name, line in [("empty.jsonl", f"--data '{tmp_path / 'empty.jsonl'}' holds no documents"),
                       ("bad.jsonl", f"{tmp_path / 'bad.jsonl'}:2: no \"text\" string; each line must be an object "
                                     "with a \"text\" string")]:
        out = tmp_path / f"from_{name}"
        assert TOKENIZE.main(["--hf_assets_path", str(TOKENIZER), "--data", str(tmp_path / name),
                              "--output_dir", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"error: {line}"
        assert not out.exists() and not partial_folder(out).exists()

    shards = text_shards(tmp_path / "raw")
    out = tmp_path / "tokens"

    real = TOKENIZE.swap_in

    def user_file_meanwhile(flag, partial, target, **about):
        out.mkdir()
        (out / "notes.txt").write_text("keep")  # added while the run tokenized
        real(flag, partial, target, **about)

    monkeypatch.setattr(TOKENIZE, "swap_in", user_file_meanwhile)
    args = ["--hf_assets_path", str(TOKENIZER), "--data", str(shards), "--output_dir", str(out)]
    assert TOKENIZE.main(args) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --output_dir '{out}' is not empty (notes.txt) and was not written by titan_lite (no "
        f"titan_lite_output.json): name a new or empty folder; nothing there was changed; the finished token folder "
        f"stays in '{partial_folder(out)}': run the same command again once the folder may be replaced")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (partial_folder(out) / MANIFEST).is_file()


# ---------------------------------------------------------------- bad token folders


def test_every_damaged_or_foreign_token_folder_is_one_line(tmp_path, tok, chat_tokenizer):
    shards = text_shards(tmp_path / "raw")

    def fresh(name: str) -> Path:
        write_token_folder(tmp_path / name, [str(shards)], RecordEncoder("text", tok), report=lambda line: None)
        return tmp_path / name

    def error(folder: Path, tokenizer: Path = TOKENIZER) -> str:
        return one_line(check_section_data, train_config(folder, tokenizer=tokenizer), "training", build_tokenizer(
            str(tokenizer)))

    key = "'training.dataset_path'"
    truncated = fresh("truncated")
    data = (truncated / shard_file(0)).read_bytes()
    (truncated / shard_file(0)).write_bytes(data[:-2])
    count = len(data) // 2
    assert error(truncated) == (f"{key} = '{truncated}': tokens-00000.bin holds {count - 1:,} values, the manifest "
                                f"says {count:,}: the token files are truncated or damaged; re-run "
                                "scripts/tokenize_data.py")
    past = fresh("past")
    offsets = np.fromfile(past / OFFSETS, dtype=np.int64)
    offsets[-2] = offsets[-1] + 5
    offsets.tofile(past / OFFSETS)
    assert error(past) == (f"{key} = '{past}': documents.int64 is damaged (document {len(offsets) - 3} ends at token "
                           f"{offsets[-2]:,}, past the {offsets[-1]:,} tokens); re-run scripts/tokenize_data.py")
    missing = fresh("missing")
    (missing / MANIFEST).unlink()
    assert error(missing) == (f"{key} = '{missing}' holds token arrays but no manifest.json: not a complete token "
                              "folder (an interrupted or damaged write); re-run scripts/tokenize_data.py into a new "
                              "folder")
    foreign = fresh("foreign")
    (foreign / MANIFEST).write_text(json.dumps({"format": "mds", "version": 2}))
    assert error(foreign) == (f"{key} = '{foreign}': manifest.json is not a titan_lite token manifest (format 'mds', "
                              "expected 'titan_lite token files')")
    wide = fresh("wide")
    manifest = json.loads((wide / MANIFEST).read_text())
    manifest["tokenizer"]["vocab_size"] = 128_256
    (wide / MANIFEST).write_text(json.dumps(manifest))
    assert error(wide) == (f"{key} = '{wide}': manifest.json stores uint16 ids, but its tokenizer has 128,256 tokens "
                           "(ids up to 65,535 fit); re-run scripts/tokenize_data.py, which picks uint32 for such "
                           "vocabularies")
    big = fresh("big")
    ids = np.fromfile(big / shard_file(0), dtype=np.uint16)
    ids[7] = 3000
    ids.tofile(big / shard_file(0))
    manifest = json.loads((big / MANIFEST).read_text())
    del manifest["max_id"]  # a folder written before the manifest recorded it: the arrays are read
    (big / MANIFEST).write_text(json.dumps(manifest))
    expected = (f"{key} = '{big}' holds token id 3,000, outside its tokenizer's vocabulary of 2,048 tokens (ids 0 to "
                "2,047): the token files are damaged; re-run scripts/tokenize_data.py")
    assert error(big) == expected
    (big / MANIFEST).write_text(json.dumps(manifest | {"max_id": 3000}))
    assert error(big) == expected
    other = fresh("other")
    message = error(other, tokenizer=chat_tokenizer)
    assert message.startswith(f"{key} = '{other}' was tokenized with another tokenizer (tokenizer.model sha256 ")
    assert message.endswith("re-run scripts/tokenize_data.py with this run's --hf_assets_path, or use the tokenizer "
                            "it was written with")
    cfg = train_config(other, tokenizer=chat_tokenizer)
    assert one_line(check_before_launch, cfg, 1) == message  # the launch refuses it before any process starts
    assert "holds text token files, but 'training.dataset' = 'instruct'" in one_line(
        check_section_data, train_config(other, "--training.dataset", "instruct"), "training")


# ---------------------------------------------------------------- reading


def test_in_order_windows_are_the_raw_texts_and_each_rank_and_worker_reads_only_its_own(tmp_path, tok):
    shards = text_shards(tmp_path / "raw")
    write_token_folder(tmp_path / "tokens", [str(shards)], RecordEncoder("text", tok), chunk_chars=4000,
                       report=lambda line: None)
    for documents in (False, True):
        raw = build_packed_source("text", str(shards), tok, 32, documents=documents)
        cfg = train_config(tmp_path / "tokens", "--training.shuffle", "false")
        tokens = build_section_source(cfg, "training", tok, documents=documents)
        assert isinstance(tokens, TokenWindows)
        count = 2 * tokens.epoch_size(0) + 5  # over the end of the data twice (the leftover carries over)
        for (a, _), (b, _) in zip(raw.samples(), tokens.samples(), strict=False):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            count -= 1
            if not count:
                break
    read: list[int] = []
    sample = tokens.sample
    tokens.sample = lambda index: read.append(index) or sample(index)
    layout = BatchLayout(local_batch=2, dp_rank=1, dp_degree=4, accumulation=2)  # G = 16
    for worker in (0, 1):
        slices = GlobalBatchSlices(tokens, layout)
        got = [s for _, (s, _) in zip(range(8), slices._by_index(worker, 2), strict=False)]
        # worker w: microbatches k % 2 == w; microbatch a of batch b holds samples 16 b + (4 a + 1) x 2 + (0, 1)
        expected = [16 * b + (4 * a + 1) * 2 + p for b in range(4) for a in range(2) for p in range(2)
                    if (2 * b + a) % 2 == worker][:8]
        assert read == expected and len(got) == 8
        assert all(torch.equal(x, y) for x, y in zip(got[0], sample(expected[0]), strict=True))
        read.clear()


def test_shuffling_is_a_seeded_permutation_per_epoch_that_keeps_examples_whole(tmp_path, tok):
    for size in (1, 5, 1000, 4099):
        order = Permutation(size, seed=7, epoch=3)
        assert sorted(order.all().tolist()) == list(range(size))
        assert [order(j) for j in range(min(size, 50))] == order.all()[:50].tolist()
    first, again, other = (GlobalOrder(100, seed, True) for seed in (0, 0, 1))
    assert first.epoch_order(0).tolist() == again.epoch_order(0).tolist()
    assert first.epoch_order(0).tolist() != first.epoch_order(1).tolist() != other.epoch_order(1).tolist()
    assert first.epoch_order(0).tolist() != list(range(100)) and not GlobalOrder(100).shuffle

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i} plus {i} is", "answer": " " + "x" * (i % 7)}) + "\n"
                            for i in range(40)))
    cfg = parse_args(["--training.dataset", "instruct", "--training.dataset_path", str(rows), "--training.seq_len",
                      "48", "--instruct.packing", "--instruct.template", "{prompt}"])
    source = build_section_source(cfg, "training", tok, documents=True)  # shuffled by default
    encoded = {tuple(source.encode(r)[0]) for _, r in source.examples()}
    epochs = []
    for epoch in range(2):
        seen = []
        for position in range(source.epoch_size(epoch)):
            inputs, _, documents = source.read(epoch, position)
            for doc in sorted(set(documents.tolist()) - {PAD_DOCUMENT}):
                at = (documents == doc).nonzero().flatten()
                piece = tuple(inputs[at].tolist())  # an example whole in its window (its last token a label when
                last = int(at[-1]) == len(inputs) - 1  # it fills the window)
                seen.append(next(e for e in encoded if e[:len(piece)] == piece and len(e) - len(piece) <= last))
        assert sorted(seen) == sorted(encoded)  # every example once an epoch
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    twin = build_section_source(cfg, "training", tok, documents=True)
    assert all(torch.equal(x, y) for x, y in zip(twin.sample(3), source.sample(3), strict=True))


def test_dry_run_states_each_ranks_data_path_and_warns_when_raw_text_starves_the_gpus(tmp_path, tok):
    shards = text_shards(tmp_path / "raw")
    write_token_folder(tmp_path / "tokens", [str(shards)], RecordEncoder("text", tok), report=lambda line: None)
    plans = {}
    for name, path in (("raw", shards), ("tokens", tmp_path / "tokens")):
        code, out, err = readme_figures.run_plan(8, str(ROOT / "train_configs" / "llama3_2_1b_pretrain.toml"), [
            "--model.hf_assets_path", "./assets/tokenizer", "--training.dataset", "text", "--training.dataset_path",
            str(path), "--training.local_batch_size", "2", "--training.seq_len", "2048"], nnodes=8)
        assert code == 0, out + err
        plans[name] = [line for line in out.splitlines() if line.startswith(("data: ", "warning: raw text"))]
    assert plans["tokens"] == [
        f"data: token files '{tmp_path / 'tokens'}' ({open_token_folder(tmp_path / 'tokens', 'k').num_tokens:,} "
        "tokens, 2 sequences per epoch, shuffled per epoch): each rank reads only its 8 of the 512 sequences of a "
        "step (each DataLoader worker only its own); 16,392 tokens read per step by each rank"]  # 2 x accumulation 4
    data, warning = plans["raw"]
    assert data == (f"data: raw text ('{shards}') read in order as a stream: every rank reads and tokenizes all 512 "
                    "sequences of a step and keeps its 8 (tokenize once with scripts/tokenize_data.py to read only its "
                    "own, and to shuffle); 1,049,088 tokens read and tokenized per step by each rank")
    assert warning.startswith("warning: raw text at data-parallel degree 64: each rank's loader tokenizes the whole "
                              "global batch, so at the measured ")
    assert warning.endswith("tokenize once with scripts/tokenize_data.py and train from the token folder")


def test_a_data_mixture_reads_its_token_folder_domains_by_index(tmp_path, tok):
    shards = text_shards(tmp_path / "raw")
    write_token_folder(tmp_path / "tokens", [str(shards)], RecordEncoder("text", tok), report=lambda line: None)
    cfg = DataMixture(enable=True, dataset_paths=[str(tmp_path / "tokens"), str(shards)], domains=["tokens", "raw"])
    assert "'training.shuffle' = true, but 'data_mixture.dataset_paths[1]'" in one_line(
        build_domain_weights, cfg, tok, 32, 0, False, True)
    mixture = build_domain_weights(cfg, tok, 32, 0, shuffle=False).source
    raw = build_packed_source("text", str(shards), tok, 32).samples()
    windows = [sample for (sample, _), _ in zip(raw, range(40), strict=False)]
    taken = [0, 0]
    for (drawn, _), _ in zip(mixture.samples(), range(40), strict=False):
        deferred = isinstance(drawn.sample, Deferred)  # a token-file domain's window: read only by the rank keeping it
        tensors, domain = drawn.load().sample, drawn.domain
        assert deferred == (domain == 0)
        assert all(torch.equal(a, b) for a, b in zip(tensors, windows[taken[domain]], strict=True))
        taken[domain] += 1
    assert min(taken) >= 10  # both domains drawn, each its windows in order (the same data)


def test_a_missing_input_is_refused_before_tokenizing_starts(tmp_path, capsys):
    missing = tmp_path / "c4" / "en"
    code = TOKENIZE.main(["--hf_assets_path", str(ROOT / "assets" / "tokenizer"), "--data", str(missing),
                          "--output_dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == f"error: --data '{missing}' does not exist\n"
