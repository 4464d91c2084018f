"""Gemma 3 (text) on the decoder in parts, against transformers' Gemma3ForCausalLM on random small models with wide
weights and sequences longer than the sliding window: equal logits, the HF round trip, a multimodal folder's text
model, packed documents equal to one document per row, greedy generation, and bad input refused in one line."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from tests.hf_oracle import check_packed_equals_alone, load_titan  # noqa: E402
from titan_lite.checkpoint.hf import write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.generate.decode import GenerationConfig, generate  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config, args_to_hf_config  # noqa: E402
from titan_lite.parallel.parallelize import refuse_hybrid_layouts  # noqa: E402
from titan_lite.transforms.base import Transforms  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
WINDOW = 16
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=256,
             sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def widened(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every norm weight drawn far from its default (0 of the (1 + w) form), so a wrong norm or placement shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def hf_model(**overrides) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(**{**SMALL, **overrides})
    config._attn_implementation = "eager"
    return widened(Gemma3ForCausalLM(config).eval().float())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    hf_model().save_pretrained(folder)
    return folder


def reference(folder) -> Gemma3ForCausalLM:
    return Gemma3ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def tokens(batch: int = 2, seq: int = 45, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_the_options_are_read_from_config_json(saved):
    args = args_from_hf_config(json.loads((saved / "config.json").read_text()))
    assert args.family == "gemma3_text" and args.schedule == ["sliding_attention"] * 5 + ["full_attention"]
    assert (args.sandwich_norms, args.embed_scale, args.norm_unit_offset, args.qk_norm, args.ffn_activation) == \
        (True, True, True, True, "gelu_tanh")
    assert (args.sliding_window, args.query_pre_attn_scalar, args.rope_theta, args.rope_local_theta) == \
        (WINDOW, 24.0, 1000000.0, 10000.0)
    assert (args.rope_scaling_type, args.rope_scaling_factor, args.tie_word_embeddings) == ("linear", 2.0, True)


def test_logits_equal_transformers_past_the_window(saved):
    ids = tokens()
    with torch.no_grad():
        expected = reference(saved)(ids).logits
        ours = load_titan(saved)(ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_packed_documents_equal_one_document_per_row(saved):
    model = load_titan(saved, attn_mask_type="block_causal")
    check_packed_equals_alone(model, [tokens(1, n, seed=10 + i)[0] for i, n in enumerate([13, 29, 22])])


def test_bfloat16_embedding_scale_and_norms_match_transformers(saved):
    """In bfloat16 the sqrt(dim) factor is rounded to bfloat16 before the product (8.0 stays exact, so a hidden size
    of 48 is used: sqrt 6.93 rounds) and the norms compute in float32: equal embeddings and norms."""
    from transformers import Gemma3TextConfig as Config

    torch.manual_seed(0)
    hf = widened(Gemma3ForCausalLM(Config(**{**SMALL, "hidden_size": 48})).eval())
    folder = saved.parent / "gemma3_bf16"
    hf.save_pretrained(folder)
    ours = load_titan(folder).to(torch.bfloat16)
    hf = hf.to(torch.bfloat16)
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(ours.embed(ids), hf.model.embed_tokens(ids))
        norm = ours.layers["0"].attention_norm
        x = torch.randn(2, 5, 48).to(torch.bfloat16)
        assert torch.equal(norm(x), hf.model.layers[0].input_layernorm(x))


def test_hf_round_trip_loads_in_transformers_with_equal_logits(saved, tmp_path):
    model = load_titan(saved)
    ids = tokens()
    for form, assets in (("rope_scaling", None), ("rope_parameters", str(saved))):  # as the source wrote it
        out = tmp_path / form
        write_hf_folder(model.state_dict(), model.args, str(out), torch.float32, assets_dir=assets)
        config = json.loads((out / "config.json").read_text())
        assert (config["model_type"], config["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
        assert form in config
        with torch.no_grad():
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
            assert type(reloaded) is Gemma3ForCausalLM
            torch.testing.assert_close(reloaded(ids).logits, model(ids), rtol=0, atol=1e-5)
        assert args_from_hf_config(config) == model.args


def test_a_multimodal_folder_loads_its_text_model_and_skips_vision(saved, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "release"
    folder.mkdir()
    text = json.loads((saved / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "architectures":
                                                    ["Gemma3ForConditionalGeneration"], "text_config": text,
                                                    "vision_config": {"num_hidden_layers": 2}}))
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(saved / "model.safetensors").items()}
    tensors |= {"model.vision_tower.patch.weight": torch.zeros(4, 3),
                "model.multi_modal_projector.proj.weight": torch.zeros(4, 4)}
    save_file(tensors, folder / "model.safetensors")
    ids = tokens()
    with caplog.at_level("INFO", logger="titan_lite"), torch.no_grad():
        torch.testing.assert_close(load_titan(folder)(ids), load_titan(saved)(ids), rtol=0, atol=0)
    assert "skipping 1 tensors of the vision tower" in caplog.text
    assert "skipping 1 tensors of the multimodal projector" in caplog.text


@pytest.mark.parametrize("overrides, message", [
    ({"final_logit_softcapping": 30.0}, "'final_logit_softcapping' is 30.0; titan_lite's Gemma3ForCausalLM supports "
                                        "only null"),
    ({"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' is 50.0"),
    ({"hidden_activation": "gelu"}, "'hidden_activation' is 'gelu'"),
    ({"use_bidirectional_attention": True}, "'use_bidirectional_attention' is True"),
    ({"model_type": "gemma3"}, "model_type 'gemma3' (Gemma 3 with a vision tower) has no 'text_config'"),
    ({"query_pre_attn_scalar": 0}, "'query_pre_attn_scalar' is 0; expected a positive number"),
    ({"layer_types": None, "sliding_window_pattern": 0}, "'sliding_window_pattern' is 0"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention's rope_type is 'linear'"),
    ({"layer_types": ["sliding_attention"] * 5 + ["linear_attention"]}, "layer_types[5] is 'linear_attention'"),
])
def test_bad_config_is_one_line(saved, overrides, message):
    cfg = {**json.loads((saved / "config.json").read_text()), **overrides}
    with pytest.raises(ConfigError, match="^config.json: ") as err:
        args_from_hf_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_sliding_window_pattern_gives_the_schedule(saved):
    cfg = {**json.loads((saved / "config.json").read_text()), "layer_types": None, "sliding_window_pattern": 3}
    assert args_from_hf_config(cfg).schedule == ["sliding_attention", "sliding_attention", "full_attention"] * 2


def test_a_release_text_config_reads_transformers_defaults():
    """A release's text_config names only what differs from Gemma3TextConfig's defaults (gemma-3-4b's keys): read
    as transformers fills it in."""
    release = {"model_type": "gemma3", "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                                       "num_hidden_layers": 34, "sliding_window": 1024,
                                                       "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}
    filled = Gemma3TextConfig(**release["text_config"]).to_dict()
    ours = args_from_hf_config(release)
    assert ours == args_from_hf_config(filled)
    assert (ours.vocab_size, ours.head_dim, ours.n_heads, ours.kv_heads, ours.rope_theta, ours.rope_local_theta,
            ours.query_pre_attn_scalar, ours.tie_word_embeddings) == (262208, 256, 8, 4, 1e6, 1e4, 256.0, True)
    assert ours.schedule == (["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4


def test_greedy_generation_equals_transformers_past_the_window(saved):
    prompts = tokens(2, 20, seed=4)
    new = 12
    with torch.no_grad():
        expected = reference(saved).generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0)[:, 20:].tolist()
    got = generate(load_titan(saved), prompts.tolist(), GenerationConfig(max_new_tokens=new), torch.device("cpu"))
    assert got == expected and got[0] != got[1]


def test_what_is_not_run_is_refused_in_one_line(saved):
    args = load_titan(saved).args
    for setting in ("tp", "cp", "pp"):  # checked against one process: tests/integration/test_gemma3_runs.py
        dims = SimpleNamespace(**{f"{name}_enabled": name == setting for name in ("tp", "cp", "pp")})
        refuse_hybrid_layouts(load_titan(saved), dims)
    with pytest.raises(ConfigError, match=r"^'model.converters' has \['sheared'\], which is not supported yet for "
                                          r"Gemma 3 .*: only \['lora', 'prune', 'quantize.linear.float8'\] have been "
                                          r"checked there$"):
        Transforms([SimpleNamespace(name="sheared")]).check(args, None)
    with pytest.raises(ConfigError, match="^model args: rope_local_theta = 10000.0 cannot be written as a "
                                          "LlamaForCausalLM, which has none$"):
        args_to_hf_config(replace(flavor_args("debugmodel"), rope_local_theta=10000.0), torch.float32)


def test_the_debug_flavor_initialises_and_exports_to_transformers(tmp_path):
    args = replace(flavor_args("debugmodel_gemma3"), max_seq_len=128)
    model = Llama(args)
    model.init_weights(seed=0)
    assert float(model.layers["0"].post_ffn_norm.weight.detach().abs().max()) == 0.0  # (1 + w): w starts at 0
    write_hf_folder(model.state_dict(), args, str(tmp_path / "hf"), torch.float32)
    ids = torch.randint(0, args.vocab_size, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = reference(tmp_path / "hf")(ids).logits
        torch.testing.assert_close(model.eval()(ids), theirs, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ published flavors

# The release configs' text model (google/gemma-3-1b-pt's config.json; the text_config of gemma-3-{4b,12b,27b}-pt,
# which names only what differs from Gemma3TextConfig's defaults) and the non-embedding parameter counts, in
# millions, of the Gemma 3 technical report (arXiv 2503.19786, Table 1; as /work/shared/reference/families_2026.md
# section 5 reproduces them).
RELEASES = {
    "gemma3_1B": ({"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
                   "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                   "vocab_size": 262144, "sliding_window": 512, "sliding_window_pattern": 6,
                   "max_position_embeddings": 32768, "query_pre_attn_scalar": 256, "rope_theta": 1000000.0,
                   "rope_local_base_freq": 10000.0, "rope_scaling": None}, 698),
    "gemma3_4B": ({"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024,
                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}, 3209),
    "gemma3_12B": ({"hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16,
                    "num_hidden_layers": 48, "num_key_value_heads": 8, "sliding_window": 1024,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}, 10759),
    "gemma3_27B": ({"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
                    "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
                    "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}, 25600),
}


@pytest.mark.parametrize("flavor", RELEASES)
def test_published_configs_are_the_flavors_with_the_reported_parameter_counts(flavor, tmp_path):
    from titan_lite.models.hf.config import flavor_of_hf_config

    text, non_embedding_millions = RELEASES[flavor]
    release = text if flavor == "gemma3_1B" else {"model_type": "gemma3", "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(release))
    assert flavor_of_hf_config(tmp_path / "config.json") == flavor
    with torch.device("meta"):
        model = Llama(flavor_args(flavor))
    total, body = model.num_params(), model.num_params(exclude_embedding=True)
    print(f"{flavor}: {total:,} parameters, {body:,} without the (tied) embedding")
    assert round(body / 1e6) == non_embedding_millions
    # and transformers' own class counts the same on the filled-in text config
    with torch.device("meta"):
        theirs = Gemma3ForCausalLM(Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"}))
    assert sum(p.numel() for p in theirs.parameters()) == total


@pytest.mark.parametrize("flavor, ngpu, gib", [("gemma3_1B", "1", 24), ("gemma3_4B", "1", 24), ("gemma3_12B", "8", 80),
                                               ("gemma3_27B", "8", 80)])
def test_the_published_flavors_plan_with_dry_run(flavor, ngpu, gib, capsys, monkeypatch):
    """QLoRA (an NF4 base) on one GPU for the two smaller sizes, full training under FSDP over 8 for the larger ones
    (full AC, 4096 tokens): each fits."""
    import re

    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", ngpu)
    lora = ["--model.converters", "lora", "--lora.base_dtype", "nf4"] if ngpu == "1" else []
    cfg = parse_args(["--model.name", "gemma3", "--model.flavor", flavor, "--model.hf_assets_path",
                      "./assets/tokenizer", "--training.seq_len", "4096", "--training.local_batch_size", "1",
                      "--activation_checkpoint.mode", "full",
                      "--dry_run.device_memory_gib", str(gib), *lora])
    assert dry_run(cfg) in (0, 5)
    out = capsys.readouterr().out
    print(out)
    assert f"model: gemma3 {flavor}, " in out and "dry run OK" in out  # (LoRA: the adapters counted in)
    assert float(re.search(r"largest peak ([\d.]+) GiB", out)[1]) < gib


def test_the_gemma3_12b_sft_recipe_plans_on_eight_gpus(capsys, monkeypatch):
    """train_configs/gemma3_12b_sft.toml before any download (the bundled tokenizer stands in): chat SFT with the
    Gemma 3 template, packed block-causal, fits 8 x 80 GB; only data and weights are missing (exit 5)."""
    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", "8")
    cfg = parse_args(["--job.config_file", "train_configs/gemma3_12b_sft.toml", "--model.hf_assets_path",
                      "./assets/tokenizer"])
    assert dry_run(cfg) == 5
    out = capsys.readouterr().out
    assert "model: gemma3 gemma3_12B, 11,766,034,176 parameters, 48 layers" in out and "dry run OK: 8 ranks" in out
    assert "block-causal" in out


def test_model_name_gemma3_needs_a_gemma3_flavor():
    from titan_lite.config import parse_args
    from titan_lite.job.plan import build_model_args

    with pytest.raises(ConfigError) as exc:
        build_model_args(parse_args(["--model.name", "gemma3", "--model.flavor", "8B"]), vocab_size=None)
    assert str(exc.value) == ("'model.name' = 'gemma3' but 'model.flavor' = '8B' is a llama model; the gemma3 flavors "
                              "are gemma3_1B, gemma3_4B, gemma3_12B, gemma3_27B (or 'hf' with a gemma3 config.json)")


def test_structured_pruning_of_the_hidden_size_is_refused_in_one_line():
    """Sheared-LLaMA's keep-sets shrink the hidden size and fold gates into block outputs: on Gemma 3 the sqrt(dim)
    embedding scale and the post norms would change what the model computes."""
    from titan_lite.transforms.structured.materialize import StructureKeep, validate_keep

    args = flavor_args("tiny_gemma3")
    every = dict(layers=list(range(4)), q_heads=[list(range(4))] * 4, kv_heads=[[0, 1]] * 4,
                 ffn=[list(range(192))] * 4)
    validate_keep(args, StructureKeep(**every, hidden=list(range(64))))
    for keep in (StructureKeep(**every, hidden=list(range(48))),
                 StructureKeep(**every, hidden=list(range(64)), layer_scale=[1.0] * 4)):
        with pytest.raises(ValueError, match="^keep-set: the gemma3_text model's hidden size \\(64\\) and block "
                                             "outputs cannot be pruned or scaled") as err:
            validate_keep(args, keep)
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------ tokenizer and chat

CHAT = [{"role": "system", "content": "Speak plainly."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": " It is 4, my lord. "}, {"role": "user", "content": "And thrice  three? ü"},
        {"role": "assistant", "content": "Nine.\n#### 9"}]


@pytest.fixture(scope="module")
def gemma_tokenizer_folder(tmp_path_factory):
    """A Gemma-format tokenizer folder: a small sentencepiece BPE (byte fallback, no dummy prefix, digits split; ids
    0-3 <pad> <eos> <bos> <unk>, then <start_of_turn> <end_of_turn>) turned into tokenizer.json by transformers'
    GemmaTokenizer (GemmaConverter's pipeline: a Replace(" ", "▁") normalizer, a Split(" ") pre-tokenizer, the
    Replace/ByteFallback/Fuse decoder), a "<bos> $A" post-processor, the turn markers special, and a
    tokenizer_config.json with Gemma 3's chat template: the files the release folders ship."""
    spm = pytest.importorskip("sentencepiece")
    from tokenizers import Tokenizer, processors
    from transformers import GemmaTokenizer

    root = tmp_path_factory.mktemp("gemma_tokenizer")
    lines = (REPO / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text().splitlines()[:400]
    (root / "corpus.txt").write_text("\n".join(lines))
    (root / "sp").mkdir()
    spm.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"), model_prefix=str(root / "sp" / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, add_dummy_prefix=False, pad_id=0,
        eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    spec = json.loads(GemmaTokenizer.from_pretrained(str(root / "sp")).backend_tokenizer.to_str())
    spec["added_tokens"] = [{**t, "special": True} for t in spec["added_tokens"] if t["content"] != "<mask>"]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    folder = root / "gemma3"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "chat_template": (REPO / "assets/chat_templates/gemma3_it.jinja").read_text()}))
    return folder


def test_a_gemma_tokenizer_json_gives_the_ids_of_tokenizers_and_transformers(gemma_tokenizer_folder):
    import tokenizers

    from titan_lite.data.tokenizer import build_tokenizer

    spec = json.loads((gemma_tokenizer_folder / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["type"] == "Split" and spec["normalizer"]["type"] == "Replace"
    ours = build_tokenizer(str(gemma_tokenizer_folder))
    oracle = tokenizers.Tokenizer.from_file(str(gemma_tokenizer_folder / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(str(gemma_tokenizer_folder))
    text = " Lear:  thou art 1234 ü€🙂 <start_of_turn>user\nhi<end_of_turn>\n  end "
    assert (ours.bos_id, ours.eos_id) == (2, 1)
    assert ours.encode(text, allow_special=True) == oracle.encode(text).ids == hf(text).input_ids
    assert spec["model"]["vocab"]["<0xF0>"] in ours.encode(text)  # the emoji's bytes: byte fallback
    assert ours.decode(ours.encode(text, bos=False, allow_special=True)) == text


def test_the_gemma3_chat_template_gives_apply_chat_templates_ids(gemma_tokenizer_folder):
    """Through the existing Jinja path: a system turn folded into the first user turn, "model" turns, trimmed
    contents; only the model's turns train (content and <end_of_turn>); generation stops at <end_of_turn>."""
    from tests.test_chat import trained_runs
    from titan_lite.data.chat import ChatEncoder, Conversation, load_chat_template
    from titan_lite.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(str(gemma_tokenizer_folder))
    encoder = ChatEncoder(load_chat_template("tokenizer", gemma_tokenizer_folder, tokenizer), tokenizer, "assistant")
    oracle = transformers.AutoTokenizer.from_pretrained(str(gemma_tokenizer_folder))
    conversation = Conversation(tuple((m["role"], m["content"]) for m in CHAT), "test")
    ids, trained = encoder.encode(conversation, "test")
    assert ids == oracle.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert oracle.decode(ids).startswith("<bos><start_of_turn>user\nSpeak plainly.\n\nWhat is 2 + 2?<end_of_turn>\n"
                                         "<start_of_turn>model\nIt is 4, my lord.<end_of_turn>\n")
    assert [tokenizer.decode(r) for r in trained_runs(ids, trained)] == ["It is 4, my lord.<end_of_turn>",
                                                                         "Nine.\n#### 9<end_of_turn>"]
    before = Conversation(conversation.turns[:-1], "test")
    assert encoder.prompt_ids(before) == oracle.apply_chat_template(CHAT[:-1], tokenize=True, return_dict=False,
                                                                    add_generation_prompt=True)
    assert encoder.end_of_turn_ids()[0] == oracle.convert_tokens_to_ids("<end_of_turn>")
