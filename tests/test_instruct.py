"""Tests of instruction data (response-only labels, padding and packing, exact resume, held-out split, file formats,
one-line errors) and of the synthetic GSM8K generator."""

import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch

from titan_lite.config import parse_args, validate
from titan_lite.data.dataloader import BatchLayout, DataLoader, build_section_loader, pad_collate, samples_per_epoch
from titan_lite.data.instruct import (
    Example,
    InstructionFile,
    InstructionSource,
    check_instruction_data,
    is_held_out,
)
from titan_lite.errors import ConfigError
from titan_lite.eval.answers import extract_answer
from titan_lite.job.plan import check_data, steps_for_epochs
from titan_lite.loss import IGNORE_INDEX, cross_entropy_sum

BOS, EOS, OFFSET = 1, 2, 3
ROOT = Path(__file__).resolve().parents[1]


def load_generator_script():
    spec = importlib.util.spec_from_file_location("make_synthetic_gsm8k", ROOT / "scripts" / "make_synthetic_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator_script()
TEMPLATE = "Q: {prompt}\nA: "


class ByteTokenizer:
    """Stand-in tokenizer: UTF-8 bytes shifted past the bos/eos ids."""

    bos_id, eos_id, pad_id = BOS, EOS, -1

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return ([BOS] if bos else []) + [b + OFFSET for b in text.encode()] + ([EOS] if eos else [])


TOK = ByteTokenizer()
PROBLEMS = [{"question": f"{i} + {i % 3}?", "answer": f"{i + i % 3}\n#### {i + i % 3}", "id": i} for i in range(40)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def config(path: Path, *extra: str):
    cfg = parse_args(["--training.dataset", "instruct", "--training.dataset_path", str(path),
                      "--instruct.template", TEMPLATE, "--training.seq_len", "32", *extra])
    validate(cfg)
    return cfg


def source(path: Path, seq_len: int = 32, packing: bool = False, split: str = "all", infinite: bool = False,
           fraction: float = 0.05) -> InstructionSource:
    cfg = config(path, "--instruct.packing", str(packing).lower(), "--instruct.validation_fraction", str(fraction))
    return InstructionSource("instruct", InstructionFile(path, cfg.instruct, "training.dataset_path"), TOK, seq_len,
                             split, infinite)


def one_line_error(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_labels_are_the_response_and_eos_only(tmp_path: Path):
    (inputs, labels), state = next(source(write_jsonl(tmp_path / "d.jsonl", PROBLEMS)).samples())
    prompt = TOK.encode("Q: 0 + 0?\nA: ")
    response = TOK.encode("0\n#### 0", bos=False, eos=True)
    assert inputs.tolist() == (prompt + response)[:-1]
    assert labels.tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + response
    assert (state["next"], state["epoch"]) == (1, 0)


def test_padding_to_the_longest_and_the_loss_counts_response_tokens(tmp_path: Path):
    src = source(write_jsonl(tmp_path / "d.jsonl", PROBLEMS))
    samples = [s for s, _ in itertools.islice(src.samples(), 4)]
    loader = DataLoader(src, BatchLayout(4, 0, 1), collate=pad_collate(EOS, IGNORE_INDEX))
    batch = next(iter(loader))
    inputs, labels = batch.inputs, batch.labels
    assert inputs.shape[1] == max(x.numel() for x, _ in samples)
    for row, (x, y) in enumerate(samples):
        assert torch.equal(inputs[row, :x.numel()], x) and (inputs[row, x.numel():] == EOS).all()
        assert torch.equal(labels[row, :y.numel()], y) and (labels[row, y.numel():] == IGNORE_INDEX).all()
    # The loss sums over response tokens only: padding and prompts add nothing.
    logits = torch.randn(*labels.shape, 300)
    response_only = sum(cross_entropy_sum(logits[r:r + 1, :y.numel()], y[None]) for r, (_, y) in enumerate(samples))
    assert torch.allclose(cross_entropy_sum(logits, labels), response_only, rtol=1e-5)
    assert int((labels != IGNORE_INDEX).sum()) == sum(int((y != IGNORE_INDEX).sum()) for _, y in samples)


def test_packing_concatenates_examples_into_windows(tmp_path: Path):
    src = source(write_jsonl(tmp_path / "d.jsonl", PROBLEMS), seq_len=16, packing=True)
    samples = [s for s, _ in src.samples()]
    stream, trained = [], []
    for record in PROBLEMS:
        ids, mask = src.encode(Example(record["question"], record["answer"]))
        stream, trained = stream + ids, trained + mask
    assert all(x.numel() == 16 for x, _ in samples)
    for k, (x, y) in enumerate(samples):
        window, window_trained = stream[k * 17:(k + 1) * 17], trained[k * 17:(k + 1) * 17]
        assert x.tolist() == window[:-1]
        assert y.tolist() == [t if m else IGNORE_INDEX for t, m in zip(window[1:], window_trained[1:], strict=True)]
    assert len(samples) == len(stream) // 17


@pytest.mark.parametrize("packing", [False, True])
def test_restarting_from_any_state_continues_exactly(tmp_path: Path, packing: bool):
    src = source(write_jsonl(tmp_path / "d.jsonl", PROBLEMS), seq_len=16, packing=packing, infinite=True)
    run = list(itertools.islice(src.samples(), 70))  # past the end of the file: a second epoch
    assert run[-1][1]["epoch"] == 1
    for k in (0, 5, 39, 45):
        state = json.loads(json.dumps(run[k][1]))  # plain values, as a checkpoint holds them
        resumed = list(itertools.islice(src.samples(state), 10))
        for (a, _), (b, _) in zip(run[k + 1:k + 11], resumed, strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("packing", [False, True])
def test_epochs_give_the_steps_of_that_many_passes(tmp_path: Path, packing: bool):
    path = write_jsonl(tmp_path / "problems.jsonl", PROBLEMS)
    cfg = config(path, "--training.epochs", "1.5", "--instruct.packing", str(packing).lower())
    per_epoch = sum(1 for _ in source(path, packing=packing).samples())
    assert samples_per_epoch(cfg, "training", TOK) == per_epoch
    assert per_epoch == 40 if not packing else 0 < per_epoch < 40
    assert steps_for_epochs(cfg, TOK, global_batch=8) == -(-3 * per_epoch // 16)  # ceil(1.5 x samples / 8)
    with pytest.raises(ConfigError, match="'training.epochs' must be a positive"):
        config(path, "--training.epochs", "0")


def test_held_out_split_is_an_even_fixed_fraction(tmp_path: Path):
    assert [i for i in range(60) if is_held_out(i, 0.05)] == [19, 39, 59]
    path = write_jsonl(tmp_path / "d.jsonl", PROBLEMS)
    train = [i for i, _ in source(path, split="train", fraction=0.1).examples()]
    held = [i for i, _ in source(path, split="heldout", fraction=0.1).examples()]
    assert held == [9, 19, 29, 39] and sorted(train + held) == list(range(40))


def test_validation_carves_from_the_training_file_only_when_it_has_no_file(tmp_path: Path):
    path = write_jsonl(tmp_path / "d.jsonl", PROBLEMS)
    cfg = config(path, "--validation.enable", "--validation.dataset", "instruct", "--validation.seq_len", "32",
                 "--instruct.validation_fraction", "0.25")
    check_data(cfg)
    train = build_section_loader(cfg, "training", TOK, BatchLayout(1, 0, 1)).source
    held = build_section_loader(cfg, "validation", TOK, BatchLayout(1, 0, 1), infinite=False).source
    assert len(list(held.examples())) == 10 and len(list(train.examples())) == 30
    assert {e.prompt for _, e in held.examples()}.isdisjoint(e.prompt for _, e in train.examples())
    own = write_jsonl(tmp_path / "val.jsonl", PROBLEMS[:3])
    cfg = config(path, "--validation.enable", "--validation.dataset", "instruct", "--validation.dataset_path",
                 str(own))
    assert len(list(build_section_loader(cfg, "training", TOK, BatchLayout(1, 0, 1)).source.examples())) == 40


def test_json_array_and_parquet_read_like_jsonl(tmp_path: Path):
    expected = list(source(write_jsonl(tmp_path / "d.jsonl", PROBLEMS)).examples())
    (tmp_path / "d.json").write_text(json.dumps(PROBLEMS))
    assert list(source(tmp_path / "d.json").examples()) == expected
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq  # only with pyarrow installed
    pq.write_table(pa.Table.from_pylist(PROBLEMS), tmp_path / "d.parquet", row_group_size=7)
    assert list(source(tmp_path / "d.parquet").examples()) == expected
    assert list(source(tmp_path / "d.parquet").file.examples(33)) == expected[33:]
    cfg = config(tmp_path / "d.parquet", "--instruct.prompt_field", "query")
    assert "no 'query' column" in one_line_error(check_instruction_data, cfg, "training")


def test_parquet_without_pyarrow_names_the_pip_of_this_python(tmp_path: Path, monkeypatch):
    import importlib

    from titan_lite.errors import pip_install

    real = importlib.import_module

    def without_pyarrow(name, *args):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *args)
    monkeypatch.setattr(importlib, "import_module", without_pyarrow)
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    message = one_line_error(lambda: list(source(tmp_path / "d.parquet").examples()))
    assert message == f"{tmp_path / 'd.parquet'}: reading it needs pyarrow ({pip_install(extra='parquet')})"
    assert "-m pip install" in message or "bin/pip install" in message  # never a bare `pip`


def test_field_file_and_template_errors_are_one_line(tmp_path: Path):
    path = write_jsonl(tmp_path / "d.jsonl", PROBLEMS)
    message = one_line_error(check_instruction_data, config(path, "--instruct.prompt_field", "query"), "training")
    assert "d.jsonl:1" in message and "'query'" in message and "instruct.prompt_field" in message
    (tmp_path / "bad.jsonl").write_text(json.dumps(PROBLEMS[0]) + "\n{oops\n")
    assert "bad.jsonl:2: not valid JSON" in one_line_error(lambda: list(source(tmp_path / "bad.jsonl").examples()))
    (tmp_path / "obj.json").write_text(json.dumps(PROBLEMS[0]))
    assert "not a JSON array" in one_line_error(lambda: list(source(tmp_path / "obj.json").examples()))
    (tmp_path / "d.csv").write_text("a,b\n")
    assert "must end in one of" in one_line_error(check_instruction_data, config(tmp_path / "d.csv"), "training")
    assert "{prompt}" in one_line_error(config, path, "--instruct.template", "Q: ")
    assert "instruct.validation_fraction" in one_line_error(
        config, path, "--validation.enable", "--validation.dataset", "instruct", "--instruct.validation_fraction", "0")
    assert "pipeline_parallel_degree" in one_line_error(
        config, path, "--validation.enable", "--validation.dataset", "instruct", "--validation.answer_problems", "4",
        "--parallelism.pipeline_parallel_degree", "2")
    assert "validation.dataset' = 'instruct'" in one_line_error(
        parse_and_validate, ["--validation.enable", "--validation.answer_problems", "4"])


def parse_and_validate(argv: list[str]) -> None:
    validate(parse_args(argv))


def test_generator_is_seeded_and_its_answers_are_right(tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "g" / "train.jsonl"
    assert gen.main(["--output", str(out), "--num_problems", "50", "--seed", "3", "--ops", "add,sub,mul"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"wrote 50 problems (add, sub, mul; operands 0..9; seed 3) to {out}"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 50 and set(records[0]) == {"question", "answer"}
    for r in records:
        work, final = r["answer"].split("\n#### ")
        expression, result = work.split(" = ")
        assert eval(expression) == int(result) == int(final) and extract_answer(r["answer"]) == final
    assert [p.record() for p in gen.make_problems(50, 3, 9, ["add", "sub", "mul"])] == records
    assert gen.make_problems(50, 4, 9, ["add"]) != gen.make_problems(50, 3, 9, ["add"])
    assert gen.main(["--output", str(out), "--ops", "div"]) == 2
    assert "--ops 'div'" in capsys.readouterr().err
