"""The chat workflow as a user runs it: scripts/make_synthetic_chat.py (conversations and the ChatML tokenizer),
scripts/show_data.py on the CPU example's config (its ids against transformers' rendering, nothing but the
assistant's turns trained), a short run of the example through run_train.sh, generation and answer accuracy with
--chat."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from titan_lite.data.instruct import is_held_out

ROOT = Path(__file__).resolve().parents[1]
CPU_EXAMPLE = ROOT / "train_configs" / "chat_lora_cpu.toml"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_script():
    return load_script("make_synthetic_chat")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> tuple[Path, Path]:
    """60 conversations and the ChatML tokenizer folder, written as docs/chat.md's first command writes them."""
    folder = tmp_path_factory.mktemp("chat")
    data, tokenizer = folder / "train.jsonl", folder / "tokenizer"
    code = chat_script().main(["--output", str(data), "--num_conversations", "60", "--seed", "0",
                               "--tokenizer_output", str(tokenizer)])
    assert code == 0
    return data, tokenizer


def test_generator_is_seeded_and_its_answers_follow_the_turns(chat_data, tmp_path, capsys):
    data, _ = chat_data
    again = tmp_path / "again.jsonl"
    assert chat_script().main(["--output", str(again), "--num_conversations", "60", "--seed", "0"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"wrote 60 conversations (391 turns; counts 0..9; seed 0) to {again}")
    assert again.read_text() == data.read_text()
    for line in data.read_text().splitlines():
        messages = json.loads(line)["messages"]
        assert [m["role"] for m in messages if m["role"] != "system"] == ["user", "assistant"] * (
            sum(m["role"] == "user" for m in messages))
        last = messages[-1]["content"]
        assert last.split("#### ")[1] in last.split("\n")[0]  # the answer is the total stated on the line above
    assert chat_script().main(["--output", str(tmp_path / "x.txt")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --output '{tmp_path / 'x.txt'}' must end in .jsonl"


def test_show_data_on_the_cpu_example_is_transformers_rendering_and_trains_only_the_assistant(chat_data, tmp_path,
                                                                                                capsys):
    transformers = pytest.importorskip("transformers")
    data, tokenizer = chat_data
    out = tmp_path / "samples.jsonl"
    code = load_script("show_data").main(["--config", str(CPU_EXAMPLE), "--count", "6", "--jsonl", str(out),
                                          "--training.dataset_path", str(data), "--model.hf_assets_path",
                                          str(tokenizer), "--training.shuffle", "false"])  # conversations in file order
    printed = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and printed[-1].startswith("packing efficiency over ") and printed[-1].endswith(
        f"; 6 samples written to {out}")
    assert printed[0].startswith("--- sample 1: 512 tokens, ") and printed[1].startswith("[document 0] <|im_start|>")
    oracle = transformers.AutoTokenizer.from_pretrained(str(tokenizer))
    conversations = [json.loads(line)["messages"] for i, line in enumerate(data.read_text().splitlines())
                     if not is_held_out(i, 0.05)]  # the training split: every 20th conversation is held out
    seen = 0
    for record in map(json.loads, out.read_text().splitlines()):
        assert set(record) == {"input_ids", "labels", "position_ids", "document_ids"}
        ids, labels, documents = (torch.tensor(record[k]) for k in ("input_ids", "labels", "document_ids"))
        for doc in sorted(set(record["document_ids"]) - {-1}):
            at = documents == doc
            messages = conversations[seen]
            expected = oracle.apply_chat_template(messages, tokenize=True, return_dict=False)
            got = ids[at].tolist()  # a conversation ending at the window's last slot has its last token as a label
            assert got == expected[:len(got)] and len(expected) - len(got) in (0, int(at[-1]))
            assert record["position_ids"][at.nonzero()[0]:][:len(got)] == list(range(len(got)))
            trained = labels[at][labels[at] != -100].tolist()
            assert oracle.decode(trained) == "".join(m["content"] + "<|im_end|>" for m in messages
                                                     if m["role"] == "assistant")
            seen += 1
    assert seen > 6  # several conversations share a window


@pytest.mark.parametrize("packing", ["true", "false"])
@pytest.mark.parametrize("mask", ["causal", "block_causal"])
def test_show_data_shows_every_packing_and_mask_type_as_training_reads_them(chat_data, tmp_path, capsys, packing,
                                                                             mask):
    """The four combinations: packed windows (whole conversations with document ids under block_causal), or one
    conversation per sample (under block_causal its own document, positions from 0, as training attends)."""
    data, tokenizer = chat_data
    out = tmp_path / "samples.jsonl"
    code = load_script("show_data").main(["--config", str(CPU_EXAMPLE), "--count", "2", "--scan", "4", "--jsonl",
                                          str(out), "--training.dataset_path", str(data), "--model.hf_assets_path",
                                          str(tokenizer), "--instruct.packing", packing, "--model.attn_mask_type",
                                          mask, "--training.shuffle", "false"])  # conversations in file order
    printed = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and printed[-1].startswith("packing efficiency over 4 samples")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    first = printed[0]
    if packing == "true":
        assert first.startswith("--- sample 1: 512 tokens, ") and len(records[0]["input_ids"]) == 512
    else:  # one conversation, as long as it is
        assert len(records[0]["input_ids"]) < 512 and first.startswith(f"--- sample 1: {len(records[0]['input_ids'])} "
                                                                         "tokens, ")
    if mask == "causal":
        assert set(records[0]) == {"input_ids", "labels"} and printed[1] == "<|im_start|>system"
        return
    assert set(records[0]) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert printed[1] == "[document 0] <|im_start|>system"
    if packing == "false":
        n = len(records[0]["input_ids"])
        assert ", 1 document, " in first and records[0]["document_ids"] == [0] * n
        assert records[0]["position_ids"] == list(range(n))


def test_show_data_help_and_errors_are_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        load_script("show_data").main(["--help"])
    assert exit_.value.code == 0 and "--jsonl" in capsys.readouterr().out
    code = load_script("show_data").main(["--config", str(CPU_EXAMPLE), "--training.dataset_path",
                                          str(tmp_path / "none.jsonl")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "none.jsonl" in err and "\n" not in err


@pytest.mark.slow  # one short training run through run_train.sh
def test_cpu_example_runs_through_run_train_and_measures_answers(chat_data, tmp_path):
    from tests.integration.harness import run_train

    data, tokenizer = chat_data
    run = run_train(["--training.dataset_path", str(data), "--model.hf_assets_path", str(tokenizer),
                     "--training.steps", "2", "--lr_scheduler.warmup_steps", "1", "--validation.freq", "2",
                     "--validation.steps", "1", "--validation.local_batch_size", "1",
                     "--validation.answer_problems", "2", "--validation.max_new_tokens", "3",
                     "--checkpoint.enable=false"], tmp_path / "run", config=CPU_EXAMPLE)
    assert run.returncode == 0, run.output[-3000:]
    assert "model llama3 debugmodel" in run.output and "answer accuracy at step 2 (first evaluation)" in run.output
    assert "'<|im_start|>user\\n" in run.output  # the held-out prompts rendered with the chat template
    assert sorted(run.printed_losses) == [1, 2]


@pytest.fixture(scope="module")
def chat_model_folder(chat_data, tmp_path_factory) -> Path:
    """The tiny model written as an HF folder with the ChatML tokenizer."""
    from titan_lite.checkpoint.hf import write_hf_folder
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=0)
    folder = tmp_path_factory.mktemp("model") / "hf"
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32, str(chat_data[1]))
    return folder


def test_generate_and_eval_answers_with_chat(chat_model_folder, chat_data, capsys):
    code = load_script("generate").main(["--hf", str(chat_model_folder), "--chat", "--prompt", "Tom has 3 apples.",
                                         "--max_new_tokens", "4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and lines[-1].startswith("generated 1 completions, ")
    assert any(line.startswith(f"prompts are user turns of the chat template {chat_model_folder}") and
               line.endswith("generation stops at token ids [1794]") for line in lines)  # <|im_end|>
    code = load_script("eval_answers").main(["--hf", str(chat_model_folder), "--chat", "--data", str(chat_data[0]),
                                             "--problems", "2", "--max_new_tokens", "3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and lines[-1].startswith("answer accuracy: ") and "/2 = " in lines[-1]
    header = next(i for i, line in enumerate(lines) if line.startswith("2 problems from "))
    assert "; chat template " in lines[header]
    samples = [line for line in lines[header:] if line.startswith("  '")]  # the conversation up to its answer
    assert len(samples) == 2 and all("<|im_start|>assistant\\n' -> " in line for line in samples)
