"""Qwen3.5 dense on the decoder in parts, against transformers' Qwen3_5ForCausalLM on random small models with wide
weights: equal logits, the HF round trip, the chunked delta rule equal to its recurrent form, packed documents equal
to one document per row (loss and gradients), and bad input refused in one line."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

from tests.hf_oracle import check_packed_equals_alone, load_titan  # noqa: E402
from titan_lite.checkpoint.hf import write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.generate.decode import GenerationConfig, generate  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config, args_to_hf_config  # noqa: E402
from titan_lite.models.parts.gated_deltanet import chunked_delta_rule, recurrent_delta_rule  # noqa: E402
from titan_lite.parallel.parallelize import refuse_hybrid_layouts  # noqa: E402
from titan_lite.transforms.base import Transforms  # noqa: E402

VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
             max_position_embeddings=256, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def widened(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every norm weight, A_log and dt_bias drawn far from its default, so a wrong norm form or decay shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(-2.0, 1.5, generator=generator))
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 2.0)
    return model


def hf_model(**overrides) -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**{**SMALL, **overrides})
    return widened(Qwen3_5ForCausalLM(config).eval().float())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf_model().save_pretrained(folder)
    return folder


def tokens(batch: int = 2, seq: int = 77, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_the_schedule_and_options_are_read_from_config_json(saved):
    args = args_from_hf_config(json.loads((saved / "config.json").read_text()))
    assert args.family == "qwen3_5" and args.schedule == ["linear_attention"] * 3 + ["full_attention"]
    assert (args.attn_output_gate, args.norm_unit_offset, args.qk_norm, args.rotary_dim) == (True, True, True, 8)
    assert (args.linear_n_key_heads, args.linear_n_value_heads, args.linear_key_head_dim,
            args.linear_value_head_dim, args.linear_conv_kernel) == (2, 4, 16, 24, 4)


def test_logits_equal_transformers(saved):
    ids = tokens()
    with torch.no_grad():
        expected = Qwen3_5ForCausalLM.from_pretrained(saved).eval()(ids).logits
        ours = load_titan(saved)(ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_the_chunked_delta_rule_equals_the_recurrent_form():
    generator = torch.Generator().manual_seed(3)
    batch, seq, key_heads, value_heads, dk, dv = 2, 45, 2, 4, 8, 6  # 45 steps: chunks of 16 leave a partial one

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).float()

    q, k, v = draw(batch, seq, key_heads, dk), draw(batch, seq, key_heads, dk), draw(batch, seq, value_heads, dv)
    g = -torch.nn.functional.softplus(draw(batch, seq, value_heads))  # decays in (0, 1)
    beta = draw(batch, seq, value_heads).sigmoid()
    state = draw(batch, value_heads, dk, dv) * 0.1
    expected, expected_state = recurrent_delta_rule(q, k, v, g, beta, state=state)
    for chunk in (1, 16, 64):
        out, final = chunked_delta_rule(q, k, v, g, beta, chunk=chunk, state=state)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(final, expected_state, rtol=0, atol=1e-5)
    # the state carries: two halves in turn are the whole
    first, mid = chunked_delta_rule(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], chunk=16)
    second, _ = chunked_delta_rule(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], beta[:, 20:], chunk=16, state=mid)
    whole, _ = chunked_delta_rule(q, k, v, g, beta, chunk=16)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=0, atol=1e-5)




def test_packed_documents_equal_one_document_per_row(saved):
    """Documents of 13, 29 and 22 tokens (none a multiple of the 16-step chunk) packed in one row: the logits, the
    summed loss and every gradient equal running each document alone from a zero state."""
    model = load_titan(saved, linear_chunk_size=16, attn_mask_type="block_causal")
    docs = [tokens(1, n, seed=10 + i)[0] for i, n in enumerate([13, 29, 22])]
    row = check_packed_equals_alone(model, docs)
    # and without the reset the first document's state leaks into the next
    leaked = model(row.ids)
    assert (leaked[:, 13:42] - row.logits[:, 13:42]).abs().max() > 1e-2


def test_hf_round_trip_loads_in_transformers_with_equal_logits(saved, tmp_path):
    model = load_titan(saved)
    out = tmp_path / "export"
    write_hf_folder(model.state_dict(), model.args, str(out), torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3_5_text", ["Qwen3_5ForCausalLM"])
    ids = tokens()
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(reloaded) is Qwen3_5ForCausalLM
        torch.testing.assert_close(reloaded(ids).logits, model(ids), rtol=0, atol=1e-5)
    assert args_from_hf_config(config) == model.args


def test_a_multimodal_folder_loads_its_text_model_and_skips_vision_and_mtp(saved, tmp_path, caplog):
    """A release folder: the config nested under text_config, the tensors under model.language_model., and vision
    and mtp.* tensors beside them, skipped and said."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "release"
    folder.mkdir()
    text = json.loads((saved / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "architectures":
                                                    ["Qwen3_5ForConditionalGeneration"], "text_config": text,
                                                    "vision_config": {"depth": 2}}))
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(saved / "model.safetensors").items()}
    tensors |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(4, 4)}
    save_file(tensors, folder / "model.safetensors")
    ids = tokens()
    with caplog.at_level("INFO", logger="titan_lite"), torch.no_grad():
        torch.testing.assert_close(load_titan(folder)(ids), load_titan(saved)(ids), rtol=0, atol=0)
    assert "skipping 1 tensors of the vision encoder" in caplog.text
    assert "skipping 1 tensors of the multi-token prediction head" in caplog.text


@pytest.mark.parametrize("overrides, message", [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
     "layer_types[1] is 'mamba'; known layer types:"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads = 3 is not a multiple of linear_num_key_heads = 2"),
    ({"num_experts": 8}, "in a dense Qwen3.5 config (model_type 'qwen3_5_text'); a Qwen3.5-MoE config says"),
    ({"attn_output_gate": False}, "'attn_output_gate' is False"),
])
def test_bad_config_is_one_line(saved, overrides, message):
    cfg = {**json.loads((saved / "config.json").read_text()), **overrides}
    with pytest.raises(ConfigError, match="^config.json: ") as err:
        args_from_hf_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_greedy_generation_equals_transformers(saved):
    """40 new tokens past a 70-token prompt (the prefill crosses a chunk): the cache holds the attention layer's K/V
    and each Gated DeltaNet layer's conv window and recurrent state."""
    prompts = tokens(2, 70, seed=4)
    new = 40
    with torch.no_grad():
        expected = Qwen3_5ForCausalLM.from_pretrained(saved).eval().generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0)[:, 70:].tolist()
    got = generate(load_titan(saved), prompts.tolist(), GenerationConfig(max_new_tokens=new), torch.device("cpu"))
    assert got == expected and got[0] != got[1]


@torch.no_grad()
def test_cached_logits_of_a_left_padded_batch_equal_full_forwards(saved):
    """A short prompt left-padded beside a long one: its padding slots leave the recurrent state at zero, so every
    step's logits equal the full forward of its own tokens."""
    model = load_titan(saved)
    short, long = tokens(1, 9, seed=6)[0].tolist(), tokens(1, 21, seed=7)[0].tolist()
    got = generate(model, [short, long], GenerationConfig(max_new_tokens=6), torch.device("cpu"))
    for prompt, continuation in zip([short, long], got, strict=True):
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert continuation == ids[len(prompt):]


def test_what_phase_one_does_not_run_is_refused_in_one_line(saved):
    args = load_titan(saved).args
    assert args_to_hf_config(args, torch.float32)["layer_types"] == args.schedule
    refuse_hybrid_layouts(load_titan(saved), SimpleNamespace(tp_enabled=False, cp_enabled=True, pp_enabled=False))
    for tp, compiled, named in ((True, False, "tensor_parallel_degree > 1"), (False, True, "compile.enable")):
        dims = SimpleNamespace(tp_enabled=tp, cp_enabled=True, pp_enabled=False)
        with pytest.raises(ConfigError, match=rf"^parallelism\.context_parallel_degree > 1 with {named} is not "
                                              "supported yet for Qwen3.5's linear_attention layers"):
            refuse_hybrid_layouts(load_titan(saved), dims, compiled)
    with pytest.raises(ConfigError, match=r"^'model.converters' has \['float8'\], which is not supported yet for "
                                          "Qwen3.5"):
        Transforms([SimpleNamespace(name="lora"), SimpleNamespace(name="float8")]).check(args, None)


def test_the_debug_flavor_initialises_and_exports_to_transformers(tmp_path):
    args = replace(flavor_args("debugmodel_qwen3_5"), max_seq_len=128)
    model = Llama(args)
    model.init_weights(seed=0)
    attention, deltanet = model.layers["3"].attention, model.layers["0"].attention
    assert float(attention.q_norm.weight.detach().abs().max()) == 0.0  # (1 + w): w starts at 0
    assert float(deltanet.norm.weight.detach().min()) == 1.0  # the gated norm is plain
    decay_rates = deltanet.A_log.detach().exp()
    assert 0.01 <= float(decay_rates.min()) and float(decay_rates.max()) <= 16
    write_hf_folder(model.state_dict(), args, str(tmp_path / "hf"), torch.float32)
    ids = torch.randint(0, args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
        torch.testing.assert_close(model.eval()(ids), theirs, rtol=0, atol=1e-5)
