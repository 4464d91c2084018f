"""gpt-oss's chat format through the chat path: a tokenizer.json of the release's structure (byte-level BPE with
o200k's split pattern, the harmony specials after the vocabulary) and a harmony template of the release's structure,
checked against `tokenizers` and transformers' apply_chat_template; the trained tokens are the format's."""

import itertools
import json
from pathlib import Path

import pytest

from tests.test_chat import chat_config, corpus_lines, one_line_error, write_jsonl
from titan_lite.data.chat import ChatEncoder, Conversation, conversation_of, load_chat_template
from titan_lite.data.instruct import InstructionFile, instruct_format
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.data.tokenizer.base import describe_tokenizer

TEMPLATE = Path(__file__).resolve().parent / "chat_templates" / "harmony_gpt_oss.jinja"
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
# the release's specials in their order after the vocabulary (199998 .. 200018 there)
NAMED = {0: "<|startoftext|>", 1: "<|endoftext|>", 4: "<|return|>", 5: "<|constrain|>", 7: "<|channel|>",
         8: "<|start|>", 9: "<|end|>", 10: "<|message|>", 14: "<|call|>", 20: "<|endofprompt|>"}
SPECIALS = [NAMED.get(k, f"<|reserved_{200000 + k - 2}|>") for k in range(21)]
MESSAGES = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "thinking": "Two and two make four.", "content": "Four."},
            {"role": "user", "content": "And thrice three?"},
            {"role": "assistant", "thinking": "Three threes are nine.", "content": "Nine.\n#### 9"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A gpt-oss-like tokenizer folder: tokenizer.json, tokenizer_config.json (bos, eos <|return|>, pad),
    chat_template.jinja and generation_config.json's three eos ids, as the release lays them out."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_lines(), trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    path = tmp_path_factory.mktemp("gpt_oss_tokenizer")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>"}))
    (path / "chat_template.jinja").write_text(TEMPLATE.read_text())
    ids = [tok.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id("<|startoftext|>"), "eos_token_id": ids,
        "pad_token_id": tok.token_to_id("<|endoftext|>")}))
    return path


def encoder(folder: Path, train_on: str = "assistant") -> ChatEncoder:
    tokenizer = build_tokenizer(str(folder))
    return ChatEncoder(load_chat_template("tokenizer", folder, tokenizer), tokenizer, train_on)


def harmony_conversation(messages: list[dict]) -> Conversation:
    turns = [(m["role"], m["content"]) for m in messages]
    return conversation_of(turns, "test", "messages", tuple((i, m["thinking"]) for i, m in enumerate(messages)
                                                            if "thinking" in m))


def trained_texts(enc: ChatEncoder, ids: list[int], trained: list[bool]) -> list[str]:
    runs = itertools.groupby(zip(ids, trained, strict=True), key=lambda x: x[1])
    return [enc.tokenizer.decode([i for i, _ in run]) for t, run in runs if t]


def test_gpt_oss_tokenizer_json_has_the_ids_of_tokenizers_and_its_stop_ids(folder):
    tokenizers = pytest.importorskip("tokenizers")
    oracle = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok = build_tokenizer(str(folder))
    assert describe_tokenizer(tok) == "tiktoken (tiktoken's core: ids in merge order, one split pattern)"
    for special in SPECIALS:
        assert tok.encode(special, bos=False, allow_special=True) == [oracle.token_to_id(special)]
    text = "<|start|>user<|message|>Thou art 12,345 fools' ÆTHER?\n\n  Nay—'tis so.<|end|><|start|>assistant"
    assert tok.encode(text, bos=False, allow_special=True) == oracle.encode(text, add_special_tokens=False).ids
    assert tok.eos_id == oracle.token_to_id("<|return|>")
    stops = encoder(folder).end_of_turn_ids()
    # generation and GRPO stop at <|return|>, <|endoftext|> and <|call|>; never at <|end|>, which closes the
    # analysis message before the final one
    assert stops == tuple(oracle.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>"))
    assert oracle.token_to_id("<|end|>") not in stops


def test_harmony_ids_equal_transformers_and_the_final_channel_trains(folder):
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoTokenizer.from_pretrained(str(folder))
    enc = encoder(folder)
    conversation = harmony_conversation(MESSAGES)
    ids, trained = enc.encode(conversation, "test")
    assert ids == oracle.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    text = enc.tokenizer.decode(ids)
    assert "Two and two make four." not in text  # earlier reasoning is dropped, as the template drops it
    # each answer trains after the generation prompt <|start|>assistant: the earlier one through <|end|>, the last
    # one with its analysis message and <|return|>; the system, developer and user messages do not
    assert trained_texts(enc, ids, trained) == [
        "<|channel|>final<|message|>Four.<|end|>",
        "<|channel|>analysis<|message|>Three threes are nine.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Nine.\n#### 9<|return|>"]
    last_ids, last = encoder(folder, "last_assistant").encode(conversation, "test")
    assert last_ids == ids and trained_texts(enc, ids, last) == trained_texts(enc, ids, trained)[1:]
    prompt = conversation.problem()[0]
    assert enc.prompt_ids(prompt) == oracle.apply_chat_template(MESSAGES[:-1], tokenize=True, return_dict=False,
                                                                add_generation_prompt=True)


def test_messages_rows_carry_thinking_into_the_template(folder, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": MESSAGES}])
    cfg = chat_config(path, folder)
    fmt = instruct_format(cfg, build_tokenizer(str(folder)))
    (_, record), = InstructionFile(path, cfg.instruct, "k").examples()
    assert record == harmony_conversation(MESSAGES)
    ids, trained = fmt.encode(record)
    assert "Three threes are nine." in fmt.tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{**MESSAGES[1], "thinking": "?"}, *MESSAGES[2:]]}])
    error = one_line_error(lambda: list(InstructionFile(bad, cfg.instruct, "k").examples()))
    assert "turn 0 (user) has a 'thinking' field" in error
    refused = write_jsonl(tmp_path / "tags.jsonl", [{"messages": [MESSAGES[1], {**MESSAGES[2],
                                                                                "content": "<|channel|>final"}]}])
    (_, tagged), = InstructionFile(refused, cfg.instruct, "k").examples()
    assert "channel tags belong in the template" in one_line_error(fmt.encode, tagged)
