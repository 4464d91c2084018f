"""DeepSeek-V3 on the decoder in parts, against transformers' DeepseekV3ForCausalLM on a random small model with wide
weights (norms, the latent norms and the correction bias far from their defaults, four expert groups): equal logits
(with and without the query's low-rank path), the HF round trip, the multi-token prediction layers skipped on load,
packed documents equal to one document per row, cached greedy generation on the latent cache equal to
transformers', the aux-loss-free bias update against the rule by hand, and what is refused in one line."""

import json
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from tests.hf_oracle import check_packed_equals_alone, load_titan  # noqa: E402
from titan_lite.checkpoint.hf import write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.generate.cache import KVCache, kv_cache_bytes  # noqa: E402
from titan_lite.generate.decode import GenerationConfig, generate  # noqa: E402
from titan_lite.job.plan import checked_balance_coeff  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config, flavor_of_hf_config  # noqa: E402
from titan_lite.models.parts.group_router import GroupRouter  # noqa: E402
from titan_lite.models.parts.mla import latent_softmax_scale  # noqa: E402
from titan_lite.parallel.parallelize import refuse_hybrid_layouts  # noqa: E402
from titan_lite.transforms.base import Transforms  # noqa: E402

VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4,
             topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24,
             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, routed_scaling_factor=2.5, norm_topk_prob=True,
             rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "original_max_position_embeddings": 64})


def widened(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every norm (the latent ones too) and the correction bias far from their defaults, a wide router: a dropped
    norm, a bias used in the weights or a group mask gone wrong shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
    return model


def hf_model(**overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    config = DeepseekV3Config(**{**SMALL, **overrides})
    config._attn_implementation = "eager"
    return widened(DeepseekV3ForCausalLM(config).eval().float())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3")
    hf_model().save_pretrained(folder)
    return folder


def hf_reloaded(folder) -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def tokens(batch: int = 2, seq: int = 77, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_the_options_are_read_from_config_json(saved):
    args = args_from_hf_config(json.loads((saved / "config.json").read_text()))
    assert args.family == "deepseek_v3" and args.schedule == ["latent_attention"] * 4
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim,
            args.rotary_dim) == (24, 32, 16, 16, 24, 16)
    assert (args.n_experts, args.moe_top_k, args.moe_ffn_dim, args.moe_layers, args.moe_shared_experts) == \
        (8, 2, 32, [1, 2, 3], 1)
    assert (args.moe_router, args.moe_n_group, args.moe_topk_group, args.moe_routed_scaling) == \
        ("sigmoid_group", 4, 2, 2.5)
    # YaRN's mscale: cos/sin times mscale / mscale_all_dim = 1, the softmax scale times (0.1 ln 4 + 1)^2
    assert latent_softmax_scale(args) == pytest.approx(32 ** -0.5 * (0.1 * 1.0 * torch.log(torch.tensor(4.0)).item()
                                                                     + 1) ** 2)


@pytest.mark.parametrize("q_lora_rank, rope_interleave", [(24, True), (None, True), (24, False)])
def test_logits_equal_transformers(tmp_path, q_lora_rank, rope_interleave):
    """The query's low-rank path or one q_proj; the rope channels paired (2i, 2i+1) as released, or rotate-half
    (permuted on load and back on export)."""
    saved = tmp_path / "hf"
    hf_model(q_lora_rank=q_lora_rank, rope_interleave=rope_interleave).save_pretrained(saved)
    ids = tokens()
    with torch.no_grad():
        expected = hf_reloaded(saved)(ids).logits
        model = load_titan(saved)
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)
    if rope_interleave:
        return
    write_hf_folder(model.state_dict(), model.args, str(tmp_path / "export"), torch.float32)
    from safetensors.torch import load_file
    exported, original = load_file(tmp_path / "export" / "model.safetensors"), load_file(saved / "model.safetensors")
    for name, tensor in original.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


def test_the_correction_bias_chooses_but_does_not_weigh(saved):
    """The bias changes which experts a token gets (so the logits), but the weights are the unbiased scores."""
    model = load_titan(saved)
    router = model.layers["1"].moe.router
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(3))
    _, weights, experts = router(x)
    scores = torch.sigmoid(x @ router.gate.weight.T)
    chosen = scores.gather(-1, experts)
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True), rtol=0, atol=1e-6)
    with torch.no_grad():
        before = model(tokens())
        router.e_score_correction_bias.zero_()
        assert not torch.equal(router(x)[2].sort(-1).values, experts.sort(-1).values)
        for block in list(model.layers.values())[1:]:
            block.moe.router.e_score_correction_bias.zero_()
        assert (model(tokens()) - before).abs().max() > 1e-2


def test_packed_documents_equal_one_document_per_row(saved):
    model = load_titan(saved, attn_mask_type="block_causal")
    docs = [tokens(1, n, seed=10 + i)[0] for i, n in enumerate([13, 29, 22])]
    check_packed_equals_alone(model, docs, grad_atol=1e-5)


def test_hf_round_trip_loads_in_transformers_with_equal_logits(saved, tmp_path):
    model = load_titan(saved)
    out = tmp_path / "export"
    write_hf_folder(model.state_dict(), model.args, str(out), torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("deepseek_v3", ["DeepseekV3ForCausalLM"])
    from safetensors.torch import load_file
    exported, original = load_file(out / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
    ids = tokens()
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert type(reloaded) is DeepseekV3ForCausalLM
        torch.testing.assert_close(reloaded(ids).logits, model(ids), rtol=0, atol=1e-5)
    assert config["num_nextn_predict_layers"] == 0  # no multi-token prediction layers are written
    assert args_from_hf_config(config) == replace(model.args, n_mtp_layers=0)


def test_mtp_layers_are_skipped_on_load_and_said(saved, tmp_path, caplog):
    """A release's multi-token prediction layer (model.layers.{num_hidden_layers}.*) is not built: skipped, logged;
    a kimi_k2 folder reads as DeepSeek-V3, said in the log."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mtp"
    folder.mkdir()
    config = {**json.loads((saved / "config.json").read_text()), "num_nextn_predict_layers": 1, "model_type": "kimi_k2"}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(saved / "model.safetensors")
    mtp = {name.replace("layers.3.", "layers.4."): t.clone() for name, t in tensors.items() if ".layers.3." in name}
    save_file({**tensors, **mtp, "model.layers.4.eh_proj.weight": torch.zeros(64, 128)}, folder / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="titan_lite"):
        model = load_titan(folder)
    assert f"skipping {len(mtp) + 1} tensors of the multi-token prediction layers" in caplog.text
    assert "model_type 'kimi_k2' read as DeepSeek-V3" in caplog.text
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), load_titan(saved)(ids), rtol=0, atol=0)


def test_greedy_generation_of_64_tokens_equals_transformers(saved):
    prompts = tokens(2, 20, seed=4)
    new = 64
    with torch.no_grad():
        expected = hf_reloaded(saved).generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0)[:, 20:].tolist()
    model = load_titan(saved)
    got = generate(model, prompts.tolist(), GenerationConfig(max_new_tokens=new), torch.device("cpu"))
    assert got == expected and got[0] != got[1] and len(set(got[0])) > 4


def test_left_padded_prompts_generate_as_each_alone(saved):
    """Prompts of 20 and 9 tokens in one batch (the shorter left-padded: its pad slots hidden from the latent's
    attention) continue as each does alone."""
    model = load_titan(saved)
    prompts = [tokens(1, 20, seed=5)[0].tolist(), tokens(1, 9, seed=6)[0].tolist()]
    config, cpu = GenerationConfig(max_new_tokens=12), torch.device("cpu")
    together = generate(model, prompts, config, cpu)
    assert together == [generate(model, [prompt], config, cpu)[0] for prompt in prompts]


def test_the_cache_holds_the_latent_not_the_expanded_keys(saved):
    model = load_titan(saved)
    args = model.args
    cache = KVCache(args, 2, 24, torch.device("cpu"))
    ids = tokens(2, 20, seed=4)
    with torch.no_grad():
        model(ids, cache=cache.step(torch.ones_like(ids, dtype=torch.bool), torch.arange(20).expand(2, 20)))
    assert not cache.keys and sorted(cache.latents) == [0, 1, 2, 3]
    assert cache.latents[0].shape == (2, 24, 32) and cache.rope_keys[0].shape == (2, 24, 1, 16)
    per_slot = 4 * (32 + 16) * 4  # four layers of latent + rope key, float32
    assert kv_cache_bytes(args, 2, 24, 4) == 2 * 24 * (per_slot + 24 + 9)


def test_aux_free_bias_update_equals_the_rule_by_hand():
    """gamma = 0.01 on loads [6, 0, 2, 4]: mean 3, signs (mean - load) = [-1, 1, 1, -1], centred (mean 0): the bias
    moves by [-0.01, 0.01, 0.01, -0.01]; loads [5, 3, 3, 1] (signs [-1, 0, 0, 1], mean 0) by [-0.01, 0, 0, 0.01]."""
    router = GroupRouter(8, 4, 2, True, 1, 1, 1.0)
    router.e_score_correction_bias.data = torch.tensor([0.1, -0.2, 0.0, 0.3])
    router.update_bias(torch.tensor([6.0, 0.0, 2.0, 4.0]), 0.01)
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([0.09, -0.19, 0.01, 0.29]))
    router.update_bias(torch.tensor([5.0, 3.0, 3.0, 1.0]), 0.01)
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([0.08, -0.19, 0.01, 0.30]))
    # uneven signs are centred: loads [0, 0, 0, 8] -> signs [1, 1, 1, -1], mean 0.5 -> [0.5, 0.5, 0.5, -1.5] gamma
    router.update_bias(torch.tensor([0.0, 0.0, 0.0, 8.0]), 0.01)
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([0.085, -0.185, 0.015, 0.285]))
    assert not router.e_score_correction_bias.requires_grad


@pytest.mark.parametrize("overrides, message", [
    ({"n_group": 3}, "n_group = 3 does not divide n_routed_experts = 8"),
    ({"topk_group": 5}, "topk_group = 5 must be between 1 and n_group = 4"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok = 5 exceeds the 2 x 2 experts"),
    ({"quantization_config": {"quant_method": "fp8"}}, "'quantization_config' is 'fp8'"),
    ({"rope_interleave": "yes"}, "'rope_interleave' is 'yes'; expected true or false"),
    ({"attention_bias": True}, "'attention_bias' is True"),
    ({"scoring_func": "softmax"}, "'scoring_func' is 'softmax'"),
])
def test_bad_config_is_one_line(saved, overrides, message):
    cfg = {**json.loads((saved / "config.json").read_text()), **overrides}
    with pytest.raises(ConfigError, match="^config.json: ") as err:
        args_from_hf_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_layout_runs_and_what_is_not_checked_is_refused_in_one_line(saved):
    args = load_titan(saved).args
    for setting in ("tp", "cp", "pp", "ep"):  # they run (tests/integration/test_deepseek_v3_runs.py)
        dims = SimpleNamespace(**{f"{name}_enabled": name == setting for name in ("tp", "cp", "pp", "ep")})
        refuse_hybrid_layouts(load_titan(saved), dims)
    with pytest.raises(ConfigError, match=r"^'model.converters' has \['sheared'\], which is not "
                                          "supported yet for DeepSeek-V3"):
        Transforms([SimpleNamespace(name="sheared")]).check(args, None)
    with pytest.raises(ConfigError, match="^model args: attn_type 'flex' does not take latent attention"):
        Llama(replace(args, attn_type="flex"))
    with pytest.raises(ConfigError, match="^model args: n_group = 3 does not divide n_routed_experts = 8"):
        Llama(replace(args, moe_n_group=3))
    with pytest.raises(ConfigError, match="^'model.load_balance_coeff' = 0.01 has no effect: flavor 'tiny_moe'"):
        checked_balance_coeff(0.01, flavor_args("tiny_moe"), "tiny_moe")
    with pytest.raises(ConfigError, match="^'model.load_balance_coeff' = -1.0 must be at least 0"):
        checked_balance_coeff(-1.0, args, "hf")


def test_the_published_parameter_counts():
    """deepseek_v3_671B: 671.0B parameters, 37.55B active counting the embedding and the head (the report's 671B /
    37B; families_2026.md's 671.0B / 37.5B); kimi_k2_1T: 1.026T / 32.9B (published 1T / 32B)."""
    counts = {}
    for flavor in ("deepseek_v3_671B", "kimi_k2_1T"):
        args = flavor_args(flavor)
        with torch.device("meta"):
            total = Llama(args).num_params()
        counts[flavor] = (round(total / 1e9, 2), round((total - args.inactive_param_count()) / 1e9, 2))
    print(counts)
    assert counts == {"deepseek_v3_671B": (671.03, 37.55), "kimi_k2_1T": (1026.41, 32.86)}


# deepseek-ai/DeepSeek-V3's config.json (its FP8 quantization_config left out)
RELEASE = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
           "aux_loss_alpha": 0.001, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
           "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
           "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
           "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
           "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
           "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
           "vocab_size": 129280}


def test_the_release_config_is_the_671B_flavor(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE))
    assert flavor_of_hf_config(tmp_path / "config.json") == "deepseek_v3_671B"
    args = args_from_hf_config(RELEASE)
    assert (args.n_mtp_layers, args.router_aux_loss_coef) == (1, 0.001)
    assert latent_softmax_scale(args) == pytest.approx(0.13523, abs=1e-5)  # 192^-1/2 x 1.3689^2


def test_the_debug_flavor_initialises_and_exports_to_transformers(tmp_path):
    args = replace(flavor_args("debugmodel_deepseek_v3"), max_seq_len=128)
    model = Llama(args)
    model.init_weights(seed=0)
    assert (model.layers["1"].moe.router.e_score_correction_bias == 0).all()
    write_hf_folder(model.state_dict(), args, str(tmp_path / "hf"), torch.float32)
    ids = torch.randint(0, args.vocab_size, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf_reloaded(tmp_path / "hf")(ids).logits
        torch.testing.assert_close(model.eval()(ids), theirs, rtol=0, atol=1e-5)
