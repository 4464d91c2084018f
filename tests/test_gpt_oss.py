"""gpt-oss on the decoder in parts, against transformers' GptOssForCausalLM (eager attention) on a random small model
with wide weights (sinks, biases and the router's bias far from their defaults): equal logits past the sliding window,
the HF round trip, packed documents equal to one document per row, cached greedy generation equal to transformers',
the parts' options, and what phase 1 refuses in one line."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

from tests.hf_oracle import check_packed_equals_alone, load_titan  # noqa: E402
from titan_lite.checkpoint.hf import write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.generate.decode import GenerationConfig, generate  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config, args_to_hf_config  # noqa: E402
from titan_lite.models.parts.sdpa import sink_attention  # noqa: E402
from titan_lite.parallel.memory_estimate import ActivationShape, layer_activation_bytes  # noqa: E402
from titan_lite.parallel.parallelize import refuse_hybrid_layouts  # noqa: E402
from titan_lite.transforms.base import Transforms  # noqa: E402

VOCAB, WINDOW = 512, 16
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
             rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


def widened(model: torch.nn.Module, seed: int = 0, experts_std: float = 0.5) -> torch.nn.Module:
    """Sinks, every bias and norm weight drawn far from its default, the experts wide enough that the SwiGLU's clamp
    at 7 bites: a dropped sink, bias or clamp, or columns de-interleaved wrong, shows in the logits."""
    generator = torch.Generator().manual_seed(seed)

    def draw(shape, std):
        return torch.randn(shape, generator=generator) * std

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(draw(param.shape, 2.0))
            elif name.endswith("router.bias"):
                param.copy_(draw(param.shape, 1.0))
            elif name.endswith(("bias", "norm.weight", "layernorm.weight")):
                param.copy_(draw(param.shape, 0.5) + (1.0 if "norm" in name else 0.0))
            elif name.endswith(("gate_up_proj", "down_proj")):
                param.copy_(draw(param.shape, experts_std))
            elif name.endswith("router.weight"):
                param.copy_(draw(param.shape, 0.3))
            elif name.endswith("embed_tokens.weight"):  # the tokens outweigh the biases: continuations differ
                param.copy_(draw(param.shape, 1.0))
    return model


def hf_model(experts_std: float = 0.5, **overrides) -> GptOssForCausalLM:
    torch.manual_seed(0)
    config = GptOssConfig(**{**SMALL, **overrides})
    config._attn_implementation = "eager"
    return widened(GptOssForCausalLM(config).eval().float(), experts_std=experts_std)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf_model().save_pretrained(folder)
    return folder


def hf_reloaded(folder) -> GptOssForCausalLM:
    return GptOssForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def tokens(batch: int = 2, seq: int = 77, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_the_options_are_read_from_config_json(saved):
    args = args_from_hf_config(json.loads((saved / "config.json").read_text()))
    assert args.family == "gpt_oss" and args.schedule == ["sliding_attention", "full_attention"] * 2
    assert (args.sliding_window, args.n_experts, args.moe_top_k, args.moe_ffn_dim) == (WINDOW, 4, 2, 48)
    assert (args.attn_sinks, args.attn_out_bias, args.qkv_bias, args.moe_router_bias, args.expert_bias) == \
        (True,) * 5
    assert (args.moe_router, args.expert_act, args.swiglu_alpha, args.swiglu_limit) == \
        ("topk_softmax", "clamped_swiglu", 1.702, 7.0)
    assert (args.rope_scaling_type, args.rope_scaling_factor, args.rope_truncate,
            args.rope_original_max_seq_len) == ("yarn", 4.0, False, 64)


def test_logits_equal_transformers_past_the_window(saved):
    ids = tokens()  # 77 tokens: the sliding layers' window of 16 cuts
    with torch.no_grad():
        expected = hf_reloaded(saved)(ids).logits
        ours = load_titan(saved)(ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_the_clamp_bites_and_the_sinks_matter(saved):
    """The wide weights exercise the parts: some gate pre-activations pass the limit, and zeroed sinks change the
    logits."""
    model = load_titan(saved)
    experts = model.layers["0"].moe.experts
    x = model.layers["0"].ffn_norm(model.tok_embeddings(tokens()[:, :30])).reshape(-1, 64)
    gates = torch.einsum("nd,ehd->neh", x, experts.w1) + experts.b1
    assert float(gates.detach().max()) > experts.limit
    ids = tokens()
    with torch.no_grad():
        before = model(ids)
        for block in model.layers.values():
            block.attention.sinks.zero_()
        assert (model(ids) - before).abs().max() > 1e-2


def test_sink_attention_equals_a_softmax_with_an_extra_key():
    """A sink is a key whose score is the sink's logit and whose value is zero."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=generator) for _ in range(3))
    sinks = torch.randn(4, generator=generator)
    scale = 8 ** -0.5
    scores = torch.cat([q @ k.transpose(-2, -1) * scale, sinks.view(1, 4, 1, 1).expand(2, 4, 9, 1)], dim=-1)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    scores[..., :9] = scores[..., :9].masked_fill(~causal, float("-inf"))
    expected = torch.softmax(scores, -1) @ torch.cat([v, torch.zeros(2, 4, 1, 8)], dim=2)
    torch.testing.assert_close(sink_attention(q, k, v, sinks, is_causal=True), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(sink_attention(q, k[:, :2], v[:, :2], sinks, attn_mask=causal),
                               sink_attention(q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1),
                                              sinks, attn_mask=causal), rtol=0, atol=0)


def test_packed_documents_equal_one_document_per_row(saved):
    """Documents of 13, 29 and 22 tokens (two longer than the window) packed in one row: the logits, the summed loss
    and every gradient equal running each document alone (the sinks and the window apply within each)."""
    model = load_titan(saved, attn_mask_type="block_causal")
    docs = [tokens(1, n, seed=10 + i)[0] for i, n in enumerate([13, 29, 22])]
    row = check_packed_equals_alone(model, docs, grad_atol=1e-5)
    packed, positions, documents, logits = row.ids, row.positions, row.documents, row.logits
    # the dense mask (CUDA's kernels, compiled blocks) gives the same logits
    dense = {key: block.attention.document_mask(documents, torch.float32, compiled=True)
             for key, block in model.layers.items()}
    h = model.tok_embeddings(packed)
    rope = model.rope_cache[positions]
    with torch.no_grad():
        for key, block in model.layers.items():
            h = block(h, rope, mask=dense[key])
        torch.testing.assert_close(model.output(model.norm(h)), logits, rtol=0, atol=1e-5)


def test_hf_round_trip_loads_in_transformers_with_equal_logits(saved, tmp_path):
    model = load_titan(saved)
    out = tmp_path / "export"
    write_hf_folder(model.state_dict(), model.args, str(out), torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gpt_oss", ["GptOssForCausalLM"])
    from safetensors.torch import load_file
    exported, original = load_file(out / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
    ids = tokens()
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert type(reloaded) is GptOssForCausalLM
        torch.testing.assert_close(reloaded(ids).logits, model(ids), rtol=0, atol=1e-5)
    assert args_from_hf_config(config) == model.args


def test_greedy_generation_equals_transformers_past_the_window(tmp_path):
    """30 new tokens after a 20-token prompt: the cache's sliding layers drop keys past the window of 16 (experts
    narrower here: the widest weights make every continuation one repeated token)."""
    saved = tmp_path / "narrow"
    hf_model(experts_std=0.05).save_pretrained(saved)
    prompts = tokens(2, 20, seed=4)
    new = 30
    with torch.no_grad():
        expected = hf_reloaded(saved).generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0)[:, 20:].tolist()
    got = generate(load_titan(saved), prompts.tolist(), GenerationConfig(max_new_tokens=new), torch.device("cpu"))
    assert got == expected and got[0] != got[1]


@pytest.mark.parametrize("overrides, message", [
    ({"attention_bias": False}, "'attention_bias' is False"),
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok' is 9; expected 1 to num_local_experts = 4"),
    ({"swiglu_limit": "x"}, "'swiglu_limit' is 'x'; expected a positive number"),
    ({"layer_types": ["sliding_attention", "mamba", "sliding_attention", "full_attention"]},
     "layer_types[1] is 'mamba'; known layer types:"),
])
def test_bad_config_is_one_line(saved, overrides, message):
    cfg = {**json.loads((saved / "config.json").read_text()), **overrides}
    with pytest.raises(ConfigError, match="^config.json: ") as err:
        args_from_hf_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_what_is_not_run_is_refused_in_one_line(saved):
    args = load_titan(saved).args
    for setting in ("tp", "cp", "pp", "ep"):  # checked against one process: tests/integration/test_gpt_oss_runs.py
        dims = SimpleNamespace(**{f"{name}_enabled": name == setting for name in ("tp", "cp", "pp", "ep")})
        refuse_hybrid_layouts(load_titan(saved), dims)
    with pytest.raises(ConfigError, match=r"^'model.converters' has \['float8'\], which is not supported yet for "
                                          r"gpt-oss .*: only \['lora', 'prune'\] have been checked"):
        Transforms([SimpleNamespace(name="lora"), SimpleNamespace(name="float8")]).check(args, None)
    assert layer_activation_bytes(args, 0, ActivationShape(tokens=64, compute_bytes=4), "none") > 0  # planned
    with pytest.raises(ConfigError, match="^model args: attn_type 'flex' does not take attention sinks"):
        Llama(replace(args, attn_type="flex"))
    llama = replace(flavor_args("debugmodel"), attn_sinks=True)
    with pytest.raises(ConfigError, match="attn_sinks = True cannot be written as a LlamaForCausalLM"):
        args_to_hf_config(llama, torch.float32)


def test_the_debug_flavor_initialises_and_exports_to_transformers(tmp_path):
    args = replace(flavor_args("debugmodel_gpt_oss"), max_seq_len=128)
    model = Llama(args)
    model.init_weights(seed=0)
    write_hf_folder(model.state_dict(), args, str(tmp_path / "hf"), torch.float32)
    ids = torch.randint(0, args.vocab_size, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf_reloaded(tmp_path / "hf")(ids).logits
        torch.testing.assert_close(model.eval()(ids), theirs, rtol=0, atol=1e-5)
