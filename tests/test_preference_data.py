"""Preference data: TRL's standard and conversational rows and UltraFeedback's whole conversations from every file
format, tokenized as two documents that share the prompt (conversations as transformers' chat template renders
them), cut or dropped to fit a window, packed whole with document ids that name pair and answer, resumed exactly,
and bad rows as one line naming file and row."""

import json
import logging
from pathlib import Path

import pytest
import torch

from titan_lite.config import parse_args, validate
from titan_lite.data.dataloader import BatchLayout, build_section_loader, build_section_source
from titan_lite.data.preference import CHOSEN, REJECTED, EncodedPair, Pair, fit_pair, pair_encoder
from titan_lite.errors import ConfigError
from titan_lite.job.plan import check_data
from titan_lite.loss import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[1]
BOS, EOS, OFFSET = 1, 2, 3


class ByteTokenizer:
    """Stand-in tokenizer: UTF-8 bytes shifted past the bos/eos ids."""

    bos_id, eos_id, pad_id = BOS, EOS, 0

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return ([BOS] if bos else []) + [b + OFFSET for b in text.encode()] + ([EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")


TOK = ByteTokenizer()
PAIRS = [{"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i + 2}", "id": i} for i in range(40)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(path: Path, *extra: str):
    cfg = parse_args(["--training.dataset", "preference", "--training.dataset_path", str(path), "--training.seq_len",
                      "64", "--training.shuffle", "false", *extra])  # pairs in file order
    validate(cfg)
    return cfg


def source(cfg, tokenizer=TOK, section: str = "training", infinite: bool = False):
    return build_section_source(cfg, section, tokenizer, infinite=infinite)


def one_line_error(fn, *args) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_standard_rows_pack_whole_pairs_as_two_documents(tmp_path: Path):
    """prompt ids (bos) then each answer's ids (eos) tokenized apart; a window holds whole pairs, each answer a
    document 2 x row + (0 chosen, 1 rejected) with labels on its answer tokens only."""
    samples = [s for s, _ in source(config(write_jsonl(tmp_path / "d.jsonl", PAIRS))).samples()]
    inputs, labels, documents = samples[0]
    assert inputs.shape == (64,)
    prompt, chosen, rejected = TOK.encode("0 + 1 =", eos=False), TOK.encode(" 1", False, True), \
        TOK.encode(" 2", False, True)
    first = prompt + chosen + prompt + rejected
    assert inputs[:len(first)].tolist() == first
    assert documents[:len(first)].tolist() == [0] * len(prompt + chosen) + [1] * len(prompt + rejected)
    trained = [i + 1 for i in range(len(first) - 1) if labels[i] != IGNORE_INDEX]
    answer_positions = [len(prompt) + i for i in range(len(chosen))]
    answer_positions += [2 * len(prompt) + len(chosen) + i for i in range(len(rejected))]
    assert trained[:len(answer_positions)] == answer_positions
    pairs = [sorted({d // 2 for d in docs.tolist() if d >= 0}) for _, _, docs in samples]
    assert [p for window in pairs for p in window] == list(range(40))  # every pair once, in order, whole
    for (_, _, docs), window in zip(samples, pairs, strict=True):
        for row in window:
            assert (docs == 2 * row).sum() + (docs == 2 * row + 1).sum() == 2 * (len(TOK.encode(f"{row} + 1 =")))\
                + len(TOK.encode(f" {row + 1}", False, True)) + len(TOK.encode(f" {row + 2}", False, True))


def test_unpacked_pairs_are_padded_one_per_row(tmp_path: Path):
    cfg = config(write_jsonl(tmp_path / "d.jsonl", PAIRS), "--preference.packing=false",
                 "--training.local_batch_size", "3")
    batch = next(iter(build_section_loader(cfg, "training", TOK, BatchLayout(3, 0, 1))))
    inputs, labels, documents = batch.inputs, batch.labels, batch.documents
    assert inputs.shape[0] == 3 and documents.shape == inputs.shape
    for row in range(3):
        ids = sorted(set(documents[row].tolist()) - {-1})
        assert ids == [2 * row, 2 * row + 1]
        assert (labels[row][documents[row] == -1] == IGNORE_INDEX).all()


def test_every_file_format_reads_alike_and_ultrafeedback_rows_split_their_prompt(tmp_path: Path):
    expected = [(i, p) for i, p in source(config(write_jsonl(tmp_path / "d.jsonl", PAIRS))).pairs()]
    assert expected[3][1] == Pair("3 + 1 =", " 4", " 5")
    (tmp_path / "d.json").write_text(json.dumps(PAIRS))
    assert list(source(config(tmp_path / "d.json")).pairs()) == expected
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq  # only with pyarrow installed
    pq.write_table(pa.Table.from_pylist(PAIRS), tmp_path / "d.parquet", row_group_size=7)
    assert list(source(config(tmp_path / "d.parquet")).pairs()) == expected
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(PAIRS).save_to_disk(str(tmp_path / "saved"))
    assert list(source(config(tmp_path / "saved")).pairs()) == expected

    def message(role, text):
        return {"role": role, "content": text}
    turns = [message("system", "Be brief."), message("user", "2+2?")]
    ultrafeedback = {"prompt": "2+2?", "chosen": turns + [message("assistant", "4")],
                     "rejected": turns + [message("assistant", "5")], "score_chosen": 8.0, "score_rejected": 2.0}
    conversational = {"prompt": turns, "chosen": [message("assistant", "4")], "rejected": [message("assistant", "5")]}
    before = [message("user", "a"), message("assistant", "b"), message("user", "c")]
    multi = {"chosen": before + [message("assistant", "d")], "rejected": before + [message("assistant", "e")]}
    rows = [p for _, p in source(config(write_jsonl(tmp_path / "c.jsonl", [ultrafeedback, conversational, multi])))
            .pairs()]
    prompt = (("system", "Be brief."), ("user", "2+2?"))
    assert rows[0] == rows[1] == Pair(prompt, (("assistant", "4"),), (("assistant", "5"),))
    assert rows[2] == Pair((("user", "a"), ("assistant", "b"), ("user", "c")), (("assistant", "d"),),
                           (("assistant", "e"),))


def chat_folder(tmp_path: Path) -> Path:
    from tests.test_chat_workflow import chat_script

    return chat_script().chat_tokenizer_folder(tmp_path / "tokenizer")


def test_conversational_pairs_render_as_transformers_chat_template(tmp_path: Path):
    """The prompt is the template's render with the generation prompt; each answer what the whole conversation adds
    (transformers' apply_chat_template ids), trained through its end-of-turn token."""
    transformers = pytest.importorskip("transformers")
    from titan_lite.data.tokenizer import build_tokenizer

    folder = chat_folder(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tom has 3 apples."}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Noted: 3."}],
           "rejected": [{"role": "assistant", "content": "Noted: 4."}]}
    standard = {"prompt": "Tom has 3 apples.", "chosen": "Noted: 3.", "rejected": "Noted: 4."}
    cfg = config(write_jsonl(tmp_path / "c.jsonl", [row, standard]), "--model.hf_assets_path", str(folder),
                 "--preference.chat_template", "tokenizer", "--training.seq_len", "256")
    src = source(cfg, build_tokenizer(str(folder)))
    (_, first), (_, second) = list(src.encoded())
    prompt_ids = hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert first.prompt == prompt_ids
    for answer, key in ((CHOSEN, "chosen"), (REJECTED, "rejected")):
        full = hf.apply_chat_template(prompt + row[key], tokenize=True, return_dict=False)
        ids, mask = first.answers[answer]
        assert first.prompt + ids == full
        trained = hf.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert trained == f"{row[key][0]['content']}<|im_end|>"
    user_turn = [{"role": "user", "content": "Tom has 3 apples."}]
    assert second.prompt == hf.apply_chat_template(user_turn, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    conversational_only = config(tmp_path / "c.jsonl", "--model.hf_assets_path", str(folder))
    assert "c.jsonl:1: a conversational pair needs a chat template" in one_line_error(check_data, conversational_only)


def test_long_pairs_are_cut_prompt_first_or_dropped():
    prompt = [BOS] + list(range(10, 30))  # 21 tokens
    pair = EncodedPair(prompt, (([5] * 6, [True] * 6), ([6] * 10, [True] * 10)))
    assert pair.length == 58
    assert fit_pair(pair, 58, "keep_end", 4, BOS) is pair
    cut = fit_pair(pair, 50, "keep_end", 4, BOS)  # the prompt gives up 4 tokens, keeping bos and its end
    assert cut.prompt == [BOS] + list(range(14, 30)) and cut.answers == pair.answers and cut.length == 50
    assert fit_pair(pair, 50, "keep_start", 4, BOS).prompt == prompt[:17]
    tight = fit_pair(pair, 20, "keep_end", 4, BOS)  # the prompt down to 4, then the longer answer first
    assert tight.prompt == [BOS, 27, 28, 29] and [len(ids) for ids, _ in tight.answers] == [6, 6]
    assert fit_pair(pair, 16, "keep_end", 4, BOS).answers == (([5] * 4, [True] * 4), ([6] * 4, [True] * 4))
    assert fit_pair(pair, 9, "keep_end", 4, BOS) is None  # nothing of the answers would train
    assert fit_pair(pair, 50, "drop", 4, BOS) is None


def test_identical_empty_and_too_long_pairs_are_named_once_and_counted(tmp_path: Path, caplog):
    rows = [*PAIRS[:3], {"prompt": "a", "chosen": " same", "rejected": " same"}, {"prompt": "b", "chosen": " x",
            "rejected": ""}, {"prompt": "c" * 80, "chosen": " y", "rejected": " z"}, PAIRS[3]]
    cfg = config(write_jsonl(tmp_path / "d.jsonl", rows), "--preference.truncation_mode", "drop")
    src = build_section_source(cfg, "training", TOK, infinite=True)
    with caplog.at_level(logging.INFO, logger="titan_lite"):
        windows = [sample for (sample, _), _ in zip(src.samples(), range(3), strict=False)]
    kept = {d // 2 for _, _, docs in windows for d in docs.tolist() if d >= 0}
    assert kept == {0, 1, 2, 6}
    text = caplog.text
    assert "d.jsonl:4: pair skipped: its answers are identical" in text
    assert "d.jsonl:5: pair skipped: its answers are empty" in text
    assert ("d.jsonl:6: pair dropped: its two documents (the prompt twice and both answers) hold 168 tokens, more "
            "than seq_len + 1 = 65 tokens (truncation_mode 'drop')") in text
    assert (f"preference data '{tmp_path / 'd.jsonl'}': 4 of 7 pairs used, 1 dropped as longer "
            "than a window (65 tokens for both answers), 1 skipped with identical answers, 1 skipped with an empty "
            "answer") in text
    cut = config(tmp_path / "d.jsonl")  # keep_end: the long pair is cut instead, and counted
    encoded = dict(source(cut).encoded())
    assert 5 in encoded and encoded[5].length == 64 and encoded[5].prompt[0] == BOS


def test_bad_rows_and_settings_are_one_line(tmp_path: Path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [PAIRS[0], {"prompt": "p", "chosen": " c"}])
    assert one_line_error(lambda: list(source(config(bad)).pairs())) == (
        f"{bad}:2: no 'rejected' string or message list ('preference.rejected_field'; fields found: chosen, prompt)")
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "p", "chosen": "c",
                                                     "rejected": [{"role": "assistant", "content": "r"}]}])
    assert "mixed.jsonl:1: 'chosen' and 'rejected' must both be strings or both message lists" in one_line_error(
        lambda: list(source(config(mixed)).pairs()))
    roles = write_jsonl(tmp_path / "roles.jsonl", [{"prompt": [{"role": "user", "content": "p"}],
                                                    "chosen": [{"role": "user", "content": "c"}],
                                                    "rejected": [{"role": "assistant", "content": "r"}]}])
    assert "roles.jsonl:1: 'chosen' turn 1 is 'user' where 'assistant' belongs" in one_line_error(
        lambda: list(source(config(roles)).pairs()))
    (tmp_path / "d.csv").write_text("a,b\n")
    assert "must end in one of .jsonl, .json, .parquet for dataset 'preference'" in one_line_error(
        check_data, config(tmp_path / "d.csv"))
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "p", "chosen": " c", "rejected": " c"}])
    assert one_line_error(check_data, config(same)) == f"'training.dataset_path' = '{same}' holds no usable pairs"
    path = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    assert one_line_error(parse_and_validate, ["--preference.beta", "0.2"]) == (
        "'preference.beta' = 0.2 has no effect: [preference] is read only when 'training.dataset' or "
        "'validation.dataset' is 'preference', which is not the case here; set --training.dataset preference or drop "
        "the setting")
    for flags, expected in [
        (["--preference.beta", "0"], "'preference.beta' must be positive, got 0.0"),
        (["--preference.beta", "-1"], "'preference.beta' must be positive, got -1.0"),
        (["--preference.label_smoothing", "0.5"], "'preference.label_smoothing' must be in [0, 0.5), got 0.5"),
        (["--preference.label_smoothing", "-0.1"], "'preference.label_smoothing' must be in [0, 0.5), got -0.1"),
        (["--preference.loss", "ipo", "--preference.label_smoothing", "0.1"], "applies to loss 'sigmoid'"),
        (["--preference.loss", "simpo", "--preference.precompute_reference"], "which is reference-free"),
        (["--model.attn_mask_type", "causal"], "'model.attn_mask_type' must be 'block_causal' (or unset)"),
        (["--validation.enable", "--validation.dataset", "shakespeare_validation"],
         "set validation.dataset = 'preference'"),
    ]:
        assert expected in one_line_error(config, path, *flags), flags


def test_what_a_newcomer_got_wrong_is_named_as_it_is(tmp_path: Path, caplog):
    """A missing template file names its key, a number where an answer belongs says so, a pair whose kept prompt
    leaves its answers no room says that (not that the answers do not fit), and a max_prompt_length that would do so
    for every long pair is refused."""
    path = write_jsonl(tmp_path / "d.jsonl", [*PAIRS[:2], {"prompt": "c" * 80, "chosen": " y", "rejected": " z"}])
    missing = str(tmp_path / "missing.jinja")
    assert one_line_error(pair_encoder, config(path, "--preference.chat_template", missing), TOK) == (
        f"'preference.chat_template' = '{missing}' is neither 'tokenizer' nor a template file")
    number = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "p", "chosen": 5, "rejected": " r"}])
    assert one_line_error(lambda: list(source(config(number)).pairs())) == (
        f"{number}:1: 'chosen' is int 5, not a string or a message list ('preference.chosen_field')")
    cfg = config(path)
    cfg.preference.max_prompt_length = 40  # as validation would refuse it
    with caplog.at_level(logging.WARNING, logger="titan_lite"):
        assert [i for i, _ in source(cfg).encoded()] == [0, 1]
    assert ("d.jsonl:3: pair dropped: its prompt, kept at 40 tokens (max_prompt_length, or a quarter of seq_len) and "
            "held twice, leaves no room for its answers in seq_len + 1 = 65 tokens") in caplog.text
    assert one_line_error(config, path, "--preference.max_prompt_length", "40") == (
        "'preference.max_prompt_length' = 40 leaves no room for the answers in a window of 'training.seq_len' + 1 = "
        "65 tokens (a pair holds its prompt twice, once per answer): set it to at most 31, or 0 (a quarter of "
        "seq_len)")


def test_the_first_pair_of_a_kind_is_named_once(tmp_path: Path, caplog):
    """The check before launch reads up to the first usable pair quietly; training, and a second pass over the same
    file (the reference precomputation's), name the first cut pair once."""
    from titan_lite.job.plan import check_section_data

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "c" * 40, "chosen": " y", "rejected": " z"}, *PAIRS[:8]])
    cfg = config(path)
    with caplog.at_level(logging.WARNING, logger="titan_lite"):
        check_section_data(cfg, "training", TOK)
        for _ in range(2):
            list(source(cfg).encoded())
    assert caplog.text.count("d.jsonl:1: pair cut to fit seq_len + 1 = 65 tokens") == 1, caplog.text


def parse_and_validate(argv: list[str]) -> None:
    validate(parse_args(argv))


def test_held_out_pairs_and_exact_resume(tmp_path: Path):
    path = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    cfg = config(path, "--validation.enable", "--validation.dataset", "preference", "--validation.seq_len", "64")
    held = [i for i, _ in source(cfg, section="validation").pairs()]
    train = [i for i, _ in source(cfg).pairs()]
    assert held == [19, 39] and sorted(held + train) == list(range(40))
    src = build_section_source(cfg, "training", TOK, infinite=True)
    stream = [(s, state) for (s, state), _ in zip(src.samples(), range(12), strict=False)]
    for at in (2, 7):
        resumed = [s for (s, _), _ in zip(src.samples(stream[at][1]), range(12 - at - 1), strict=False)]
        for a, b in zip(resumed, [s for s, _ in stream[at + 1:]], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
