"""Chat data: conversations rendered with published chat templates (Llama 3, Llama 3.2, ChatML as SmolLM2 and Qwen2.5
use it, Mistral, Gemma 3) give transformers' apply_chat_template ids and train the assistant's turns only; the row
formats and file kinds; one-line errors; whole-record packing with document ids; pre-training documents."""

import itertools
import json
from pathlib import Path

import pytest
import torch

from titan_lite.config import parse_args, validate
from titan_lite.data.chat import ChatEncoder, Conversation, load_chat_template
from titan_lite.data.dataloader import build_section_source, samples_per_epoch
from titan_lite.data.datasets import DocumentStream, PackedSource, document_positions
from titan_lite.data.instruct import PAD_DOCUMENT, InstructionFile, check_instruction_data, instruct_format
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.errors import ConfigError
from titan_lite.loss import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "chat_templates"
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# name: (template file, special tokens, bos, eos, the text that ends an assistant turn, content trimmed)
CASES = {
    "llama3": (ROOT / "assets/chat_templates/llama3_instruct.jinja", LLAMA3_SPECIALS, "<|begin_of_text|>",
               "<|eot_id|>", "<|eot_id|>", True),
    "llama3_2": (TEMPLATES / "llama3_2_instruct.jinja", LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>",
                 "<|eot_id|>", True),
    "chatml_smollm2": (TEMPLATES / "chatml_smollm2.jinja", CHATML_SPECIALS, None, "<|im_end|>", "<|im_end|>", False),
    "qwen2_5": (TEMPLATES / "qwen2_5_instruct.jinja", CHATML_SPECIALS, None, "<|im_end|>", "<|im_end|>", False),
    "qwen2_5_generation": (TEMPLATES / "qwen2_5_generation.jinja", CHATML_SPECIALS, None, "<|im_end|>", "<|im_end|>",
                           False),
    "mistral": (TEMPLATES / "mistral_instruct.jinja", ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>",
                False),
    # Gemma 3: the assistant's role is "model", a system turn folds into the first user turn
    "gemma3": (ROOT / "assets/chat_templates/gemma3_it.jinja", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
               "<bos>", "<eos>", "<end_of_turn>", True),
}
SYSTEM = {"role": "system", "content": "Speak plainly."}
TURNS = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": " It is 4, my lord. "},
         {"role": "user", "content": "And thrice three?"}, {"role": "assistant", "content": "Nine.\n#### 9"}]


def corpus_lines() -> list[str]:
    return (ROOT / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text().splitlines()[:400]


def chat_tokenizer_folder(folder: Path, name: str) -> Path:
    """A small byte-level BPE trained with `tokenizers` plus the template's special tokens, saved with a
    tokenizer_config.json holding the published chat template (what transformers loads as the oracle)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    template, specials, bos, eos, *_ = CASES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_lines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "chat_template": template.read_text()}
    if bos:
        config["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {name: chat_tokenizer_folder(root / name, name) for name in CASES}


def conversation(name: str) -> list[dict[str, str]]:
    return TURNS if name == "mistral" else [SYSTEM, *TURNS]  # Mistral's template refuses system turns


def encoder(folder: Path, train_on: str = "assistant") -> ChatEncoder:
    tokenizer = build_tokenizer(str(folder))
    return ChatEncoder(load_chat_template("tokenizer", folder, tokenizer), tokenizer, train_on)


def as_conversation(messages: list[dict[str, str]]) -> Conversation:
    return Conversation(tuple((m["role"], m["content"]) for m in messages), "test")


def trained_runs(ids: list[int], trained: list[bool]) -> list[list[int]]:
    return [[i for i, _ in run] for t, run in itertools.groupby(zip(ids, trained, strict=True), key=lambda x: x[1])
            if t]


@pytest.mark.parametrize("name", sorted(CASES))
def test_ids_match_transformers_and_only_assistant_turns_train(folders, name):
    transformers = pytest.importorskip("transformers")
    folder, messages = folders[name], conversation(name)
    _, _, _, _, end, trimmed = CASES[name]
    oracle = transformers.AutoTokenizer.from_pretrained(str(folder))
    enc = encoder(folder)
    ids, trained = enc.encode(as_conversation(messages), "test")
    assert ids == oracle.apply_chat_template(messages, tokenize=True, return_dict=False)
    # each assistant turn trains: its content (as the template writes it) and the end-of-turn token after it
    contents = [m["content"].strip() if trimmed else m["content"] for m in messages if m["role"] == "assistant"]
    assert [enc.tokenizer.decode(run) for run in trained_runs(ids, trained)] == [c + end for c in contents]
    if name == "qwen2_5_generation":  # the template marks them itself: transformers' assistant mask is the oracle
        masks = oracle.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)["assistant_masks"]
        assert [int(t) for t in trained] == masks
    # generation: the conversation before the last answer, with the generation prompt; stop at the end token
    before = as_conversation(messages[:-1])
    assert enc.prompt_ids(before) == oracle.apply_chat_template(messages[:-1], tokenize=True, return_dict=False,
                                                                add_generation_prompt=True)
    assert enc.end_of_turn_ids()[0] == oracle.convert_tokens_to_ids(end)


def test_last_assistant_turn_or_every_token(folders):
    folder = folders["qwen2_5"]
    whole = as_conversation(conversation("qwen2_5"))
    ids, last = encoder(folder, "last_assistant").encode(whole, "test")
    assert [encoder(folder).tokenizer.decode(r) for r in trained_runs(ids, last)] == ["Nine.\n#### 9<|im_end|>"]
    ids_all, every = encoder(folder, "all").encode(whole, "test")
    assert ids_all == ids and all(every)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_config(data: Path, tokenizer: Path, *extra: str):
    cfg = parse_args(["--training.dataset", "instruct", "--training.dataset_path", str(data),
                      "--model.hf_assets_path", str(tokenizer), "--instruct.chat_template", "tokenizer",
                      "--training.seq_len", "64", *extra])
    validate(cfg)
    return cfg


def one_line_error(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_messages_sharegpt_and_prompt_response_rows_are_the_same_conversation(folders, tmp_path):
    folder = folders["chatml_smollm2"]
    messages = [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A fool."}]
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in messages]
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": messages}, {"conversations": sharegpt},
                                                 {"question": "Who art thou?", "answer": "A fool."}])
    cfg = chat_config(path, folder)
    fmt = instruct_format(cfg, build_tokenizer(str(folder)))
    encoded = [fmt.encode(record) for _, record in InstructionFile(path, cfg.instruct, "k").examples()]
    assert encoded[0] == encoded[1] == encoded[2]
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"chat": messages}])
    cfg = chat_config(renamed, folder, "--instruct.messages_field", "chat")
    assert [r for _, r in InstructionFile(renamed, cfg.instruct, "k").examples()] == [as_conversation(messages)]


def test_json_parquet_and_saved_datasets_folders_read_like_jsonl(tmp_path):
    rows = [{"messages": [SYSTEM, *TURNS]}, {"messages": TURNS[:2]}]
    cfg = parse_args(["--training.dataset", "instruct"]).instruct
    expected = list(InstructionFile(write_jsonl(tmp_path / "d.jsonl", rows), cfg, "k").examples())
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert list(InstructionFile(tmp_path / "d.json", cfg, "k").examples()) == expected
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq  # only with pyarrow installed

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert list(InstructionFile(tmp_path / "d.parquet", cfg, "k").examples()) == expected
    datasets = pytest.importorskip("datasets")  # test-only: writes the folder titan_lite reads without it
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    assert list(InstructionFile(tmp_path / "saved" / "train", cfg, "k").examples()) == expected
    message = one_line_error(InstructionFile, tmp_path / "saved", cfg, "training.dataset_path")
    assert message == (f"'training.dataset_path' = '{tmp_path / 'saved'}' is a DatasetDict saved with datasets' "
                       f"save_to_disk (splits: train): name one split's folder, e.g. '{tmp_path / 'saved' / 'train'}'")


def test_bad_conversations_are_one_line_naming_file_and_row(folders, tmp_path):
    folder = folders["mistral"]
    cases = [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "d.jsonl:2: 'messages' has no assistant turn"),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, "d.jsonl:2: 'messages' turn 0 is 'assistant'"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}]},
         "d.jsonl:2: 'messages' turn 1 is 'user' where 'assistant' belongs"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "A"}]},
         "d.jsonl:2: 'messages' turn 0 (user) has no text content (missing"),
        ({"conversations": [{"from": "bot", "value": "A"}]}, "d.jsonl:2: 'conversations' turn 0 has from 'bot'"),
        ({"messages": [SYSTEM, *TURNS]}, "d.jsonl:2: the chat template ("),
        ({"prompt": "Hi"}, "d.jsonl:2: no 'question' string"),
    ]
    good = {"messages": TURNS}
    messages = []
    for record, expected in cases:
        path = write_jsonl(tmp_path / "d.jsonl", [good, record])
        cfg = chat_config(path, folder)
        source = build_section_source(cfg, "training", build_tokenizer(str(folder)), infinite=False)
        messages.append(one_line_error(lambda s=source: list(s.samples())))
        assert expected in messages[-1], messages[-1]
    assert messages[5].endswith("TemplateError: Conversation roles must alternate user/assistant/user/assistant/...")
    no_template = parse_args(["--training.dataset", "instruct", "--training.dataset_path", str(path)])
    assert "a conversation needs a chat template" in one_line_error(check_instruction_data, no_template, "training")
    missing = chat_config(path, tmp_path)  # a folder without a tokenizer_config.json
    assert "has no chat_template.jinja" in one_line_error(check_instruction_data, missing, "training")


def packed_source(folder: Path, data: Path, seq_len: int):
    cfg = chat_config(data, folder, "--instruct.packing", "--training.seq_len", str(seq_len), "--training.shuffle",
                      "false")  # records in file order
    return build_section_source(cfg, "training", build_tokenizer(str(folder)), infinite=True, documents=True), cfg


def test_whole_conversations_pack_with_documents_positions_and_no_label_across(folders, tmp_path):
    folder = folders["chatml_smollm2"]
    rows = [{"messages": TURNS[:2 + 2 * (i % 2)]} for i in range(12)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    source, cfg = packed_source(folder, data, seq_len=320)
    encoded = [source.encode(r) for _, r in source.examples()]
    windows = list(itertools.islice(source.samples(), 8))
    placed = 0
    assert max(len(set(d.tolist()) - {PAD_DOCUMENT}) for (_, _, d), _ in windows) >= 3
    for (inputs, labels, documents), _ in windows:
        assert inputs.shape == labels.shape == documents.shape == (320,)
        tokens = torch.cat([inputs, labels[-1:]])
        docs = torch.cat([documents, documents[-1:]])
        for doc in sorted(set(docs.tolist()) - {PAD_DOCUMENT}):
            ids, trained = encoded[placed % len(encoded)]
            at = (docs == doc).nonzero().flatten()
            if at[-1] < 320:  # a record that ends before the window's last slot: all its tokens are inputs
                assert tokens[at].tolist() == ids
            # its labels: the next token where it trains, nothing across the boundary into the next record
            expected = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], trained[1:], strict=True)] + [IGNORE_INDEX]
            assert labels[at[at < 320]].tolist() == expected[:int((at < 320).sum())]
            assert document_positions(documents)[at[at < 320]].tolist() == list(range(int((at < 320).sum())))
            placed += 1
        assert (labels[documents == PAD_DOCUMENT] == IGNORE_INDEX).all()
    # restarting from any state continues exactly, over the epoch boundary too
    run = list(itertools.islice(source.samples(), 12))
    for k in (0, 3, 7):
        resumed = list(itertools.islice(source.samples(json.loads(json.dumps(run[k][1]))), 4))
        for (a, _), (b, _) in zip(run[k + 1:k + 5], resumed, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert samples_per_epoch(cfg, "training", build_tokenizer(str(folder)), documents=True) < len(rows)


def test_pretraining_documents_carry_ids_and_resume(tmp_path):
    texts = ["To be, or not to be, that is the question.", "What light through yonder window breaks?",
             "Friends, Romans, countrymen.", "Now is the winter of our discontent."] * 3
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    tokenizer = build_tokenizer(str(ROOT / "assets/tokenizer"))
    source = PackedSource("jsonl", DocumentStream([path]), tokenizer, seq_len=24, infinite=True, documents=True)
    plain = PackedSource("jsonl", DocumentStream([path]), tokenizer, seq_len=24, infinite=True)
    stream = [i for t in texts for i in tokenizer.encode(t, bos=True, eos=True)]
    run = list(itertools.islice(source.samples(), 10))
    for k, ((inputs, labels, documents), _) in enumerate(run[:5]):
        (plain_inputs, plain_labels), _ = next(itertools.islice(plain.samples(), k, None))
        assert inputs.tolist() == stream[k * 25:k * 25 + 24] == plain_inputs.tolist()
        bos = inputs == tokenizer.bos_id
        assert (documents[1:] != documents[:-1]).tolist() == bos[1:].tolist()  # a new document at each bos
        boundary = torch.cat([documents[1:] != documents[:-1], torch.tensor([False])])
        assert (labels[boundary] == IGNORE_INDEX).all()  # eos never predicts the next document's bos
        assert torch.equal(labels[~boundary], plain_labels[~boundary])
    for k in (1, 6):
        resumed = list(itertools.islice(source.samples(json.loads(json.dumps(run[k][1]))), 3))
        for (a, _), (b, _) in zip(run[k + 1:k + 4], resumed, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # a data mixture's samples carry the documents too, its domain id last; a loader batch splits into both
    from titan_lite.config.schema import DataMixture
    from titan_lite.data.dataloader import stack_collate
    from titan_lite.data.mixture import build_domain_weights

    mixture = build_domain_weights(DataMixture(enable=True, dataset_paths=[str(path)]), tokenizer, 24, 0,
                                   documents=True).source
    batch, _ = stack_collate(list(itertools.islice(mixture.samples(), 2)))
    assert batch.documents.shape == batch.inputs.shape == (2, 24) and batch.domains.tolist() == [0, 0]
    assert torch.equal(batch.documents[0], run[0][0][2])


def test_config_keys_flavors_and_refusals():
    from titan_lite.job.plan import build_model_args
    from titan_lite.models.flavors import flavor_args

    for flavor in ("debugmodel_flex_attn", "8B_flex"):
        args = flavor_args(flavor)
        assert (args.attn_type, args.attn_mask_type) == ("flex", "block_causal")
    cfg = parse_args(["--model.flavor", "debugmodel", "--model.attn_mask_type", "block_causal"])
    assert build_model_args(cfg, None).attn_mask_type == "block_causal"
    assert build_model_args(parse_args([]), None).attn_mask_type == "causal"
    assert "'model.attn_type' = 'varlen' is not supported" in one_line_error(
        validate, parse_args(["--model.attn_type", "varlen"]))
    assert "'instruct.train_on' = 'system' is not one of: assistant, last_assistant, all" in one_line_error(
        parse_args, ["--instruct.train_on", "system"])
