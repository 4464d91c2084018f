"""Mixture of experts (Qwen3-MoE) as an option of the one decoder, against transformers: logits of a random
Qwen3MoeForCausalLM, its load-balancing loss, the grouped matmul against the loop, the aux loss's gradient, the
published flavors' shapes and parameter counts."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from tests.helpers import hf_family_model  # noqa: E402
from titan_lite.checkpoint.hf import load_hf_weights  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config  # noqa: E402
from titan_lite.models.parts.experts import grouped_mm, grouped_mm_runs  # noqa: E402
from titan_lite.models.parts.moe import MoE  # noqa: E402
from titan_lite.models.parts.router import Routing, load_balancing_loss  # noqa: E402

SEQ = 24


def tokens(batch: int = 2, vocab: int = 2048) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, SEQ), generator=torch.Generator().manual_seed(7))


def load_titan(folder: Path) -> Llama:
    args = args_from_hf_config(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=123)
    load_hf_weights([model], str(folder), args)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """transformers' random Qwen3-MoE (3 layers, layer 1 dense), saved, with its logits and router logits."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    model = hf_family_model("qwen3_moe")
    model.save_pretrained(folder)
    with torch.no_grad():
        out = model(tokens(), output_router_logits=True)
    return folder, out.logits, out.router_logits


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_equal_transformers_qwen3_moe(tmp_path, norm_topk_prob):
    """Router, top-k (renormalised or not), grouped experts, the dense layer among MoE ones, per-expert HF keys."""
    reference = hf_family_model("qwen3_moe", norm_topk_prob=norm_topk_prob)
    reference.save_pretrained(tmp_path)
    model = load_titan(tmp_path)
    assert model.args.moe_layers == [0, 2] and model.args.moe_norm_topk_prob == norm_topk_prob
    assert not model.layers["1"].moe_enabled and model.layers["0"].moe.experts.w1.shape == (8, 32, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), reference(tokens()).logits, atol=1e-5, rtol=0)


def test_loop_and_grouped_matmul_give_the_same_logits(saved, monkeypatch):
    """The CPU takes torch._grouped_mm for these 16-byte-aligned shapes; the loop over experts is the same model."""
    folder, reference, _ = saved
    model = load_titan(folder)
    assert grouped_mm_runs(torch.zeros(1, 64), model.layers["0"].moe.experts.w1)
    monkeypatch.setattr("titan_lite.models.parts.experts.grouped_mm_runs", lambda x, w: False)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), reference, atol=1e-5, rtol=0)


def test_grouped_matmul_equals_the_loop_forward_and_backward():
    """Including experts that receive no token, and 30-float rows (not 16-byte aligned: the loop runs)."""
    counts = torch.tensor([5, 0, 7, 3, 0, 4, 8, 1])
    for width in (32, 30):
        x = torch.randn(int(counts.sum()), width, requires_grad=True)
        weight = torch.randn(8, 24, width, requires_grad=True)
        assert grouped_mm_runs(x, weight) == (width == 32)
        out = grouped_mm(x, weight, counts)
        grads = torch.autograd.grad((out * out).sum(), (x, weight))
        rows = x.split(counts.tolist())
        expected = torch.cat([r @ weight[e].T for e, r in enumerate(rows)])
        expected_grads = torch.autograd.grad((expected * expected).sum(), (x, weight))
        torch.testing.assert_close(out, expected)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------ aux loss


def router_logits_of(model: Llama, inputs: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's router logits [tokens, E], captured by forward hooks."""
    captured = []
    hooks = [layer.moe.router.gate.register_forward_hook(lambda m, i, o: captured.append(o))
             for layer in model.layers.values() if layer.moe_enabled]
    model(inputs)
    for hook in hooks:
        hook.remove()
    return captured


def stats_of(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k assignment counts [E], probability sums [E]) of router logits [tokens, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    routing = Routing.of(probs, *probs.topk(top_k, dim=-1))
    return routing.counts.float(), probs.sum(0)


def test_load_balancing_loss_equals_transformers(saved):
    """On the same router logits: pooled over layers and tokens as transformers pools them, and per sequence."""
    folder, _, hf_router_logits = saved
    model = load_titan(folder)
    with torch.no_grad():
        ours = router_logits_of(model, tokens())
    for mine, theirs in zip(ours, hf_router_logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    stats = [stats_of(logits, 2) for logits in hf_router_logits]
    pooled = load_balancing_loss(sum(c for c, _ in stats), sum(p for _, p in stats), 2 * 2 * SEQ)
    expected = load_balancing_loss_func(tuple(hf_router_logits), 8, 2)
    torch.testing.assert_close(pooled, expected, atol=1e-6, rtol=0)
    first_sequence = hf_router_logits[0][:SEQ]
    counts, prob_sums = stats_of(first_sequence, 2)
    torch.testing.assert_close(load_balancing_loss(counts, prob_sums, SEQ),
                               load_balancing_loss_func((first_sequence,), 8, 2), atol=1e-6, rtol=0)


def test_training_backpropagates_the_aux_loss_of_each_sequence_and_layer():
    """With aux_loss_scale s on every MoE layer, the gradients are those of loss + s x sum over (sequence, layer) of
    transformers' load_balancing_loss_func on that sequence's router logits; the step's sums record the loss and the
    load, and activation checkpointing's recompute does not count them twice."""
    from titan_lite.config.schema import ActivationCheckpoint
    from titan_lite.parallel.activation_checkpoint import apply_ac

    args = flavor_args("tiny_moe")
    model = Llama(args)
    model.init_weights(seed=5)
    inputs, scale = tokens(3), 0.37
    params = [p for p in model.parameters()]

    logits_per_layer = router_logits_of(model, inputs)
    aux_terms = [load_balancing_loss_func((layer[b * SEQ:(b + 1) * SEQ],), 8, 2)
                 for layer in logits_per_layer for b in range(3)]
    model.zero_grad()
    (model(inputs).square().mean() + scale * sum(aux_terms)).backward()
    expected = [p.grad.clone() for p in params]

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.aux_loss_scale = scale
        moe.reset_stats()
    model.zero_grad()
    model.train()
    apply_ac(model, ActivationCheckpoint(mode="full"))  # every block's forward runs again inside the backward
    model(inputs).square().mean().backward()
    for p, want in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sum(m.aux_loss_sum for m in moes), sum(aux_terms).detach(), atol=1e-6, rtol=0)
    assert [int(m.tokens_per_expert.sum()) for m in moes] == [3 * SEQ * 2] * len(moes)


# ------------------------------------------------------------------------------------------ flavors


PUBLISHED = {
    "qwen3_30B_A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4),
    "qwen3_235B_A22B": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4),
}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_published_qwen3_moe_configs_are_the_flavors(flavor, tmp_path):
    """The Hub's config.json keys of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B."""
    from titan_lite.models.hf.config import flavor_of_hf_config

    config = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=128, vocab_size=151936,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=0.001, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu",
                  use_sliding_window=False, **PUBLISHED[flavor])
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert flavor_of_hf_config(tmp_path / "config.json") == flavor


@pytest.mark.parametrize("flavor, total, active", [("qwen3_30B_A3B", 30_532_122_624, 3_353_032_704),
                                                   ("qwen3_235B_A22B", 235_093_634_560, 22_190_763_520)])
def test_qwen3_moe_parameter_counts(flavor, total, active):
    """Qwen's published 30.5B total / 3.3B active and 235B / 22B."""
    args = flavor_args(flavor)
    with torch.device("meta"):
        model = Llama(args)
    assert model.num_params() == total
    assert model.num_params() - args.inactive_param_count() == active


def test_moe_init_is_by_name_and_seeded():
    """Each expert weight is drawn whole from its own name's generator: the same init whatever the layout; the
    residual-output projections (w2, w3) are scaled down with depth like the dense ones."""
    args = flavor_args("tiny_moe")
    first, second = Llama(args), Llama(args)
    first.init_weights(seed=1)
    second.init_weights(seed=1)
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b), name
    experts = first.layers["3"].moe.experts
    assert experts.w1.std().item() == pytest.approx(0.02 * 0.88, rel=0.1)  # trunc_normal at 2 std: std x 0.88
    assert experts.w2.std().item() == pytest.approx(0.02 / 8 ** 0.5 * 0.88, rel=0.1)
    assert not torch.equal(experts.w1[0], experts.w1[1])


# ------------------------------------------------------------------------------------------ HF folders


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hf_round_trip_is_byte_identical_and_exports_the_same_class(family, tmp_path):
    """transformers' folder -> hf-to-dcp -> dcp-to-hf: the same per-expert tensors under the same names, the same
    model_type; transformers' class loads the export with the same logits (Mixtral: block_sparse_moe.experts.{j}.w1
    names, a window shorter than the sequence)."""
    from tests.test_hf import load_script

    reference = hf_family_model(family)
    reference.save_pretrained(tmp_path / "source")
    with torch.no_grad():
        expected = reference(tokens()).logits
    torch.testing.assert_close(load_titan(tmp_path / "source")(tokens()), expected, atol=1e-5, rtol=0)
    convert = load_script("convert_checkpoint")
    assert convert.main(["hf-to-dcp", str(tmp_path / "source"), str(tmp_path / "dcp")]) == 0
    assert convert.main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--hf_config",
                         str(tmp_path / "source" / "config.json")]) == 0
    original, back = safetensors_of(tmp_path / "source"), safetensors_of(tmp_path / "hf")
    assert sorted(back) == sorted(original)
    assert any(".experts.7." in name for name in back)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(exported).__name__ == type(reference).__name__
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, expected, atol=1e-5, rtol=0)


def test_titan_moe_exports_to_qwen3_moe_with_the_same_logits(tmp_path):
    from titan_lite.checkpoint.hf import write_hf_folder

    args = flavor_args("tiny_moe")
    model = Llama(args)
    model.init_weights(seed=2)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    write_hf_folder(dict(model.named_parameters()), args, str(tmp_path / "hf"), torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_experts"], config["mlp_only_layers"], config["norm_topk_prob"]) == (8, [1], True)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, model.eval()(tokens()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok' is 9; expected 1 to num_experts = 8"),
    ({"model_type": "mixtral", "router_jitter_noise": 0.1, "num_local_experts": 8},
     "'router_jitter_noise' is 0.1; titan_lite's MixtralForCausalLM supports only 0"),
])
def test_moe_configs_titan_lite_cannot_represent_are_one_line(overrides, message):
    from titan_lite.errors import ConfigError
    from titan_lite.models.hf.config import args_to_hf_config

    config = {**args_to_hf_config(flavor_args("tiny_moe"), torch.float32), **overrides}
    with pytest.raises(ConfigError) as exc:
        args_from_hf_config(config, source="config.json")
    assert str(exc.value) == f"config.json: {message}"


def test_a_moe_model_cannot_be_written_as_a_dense_family_or_mixtral_with_dense_layers():
    from titan_lite.errors import ConfigError
    from titan_lite.models.hf.config import args_to_hf_config

    args = flavor_args("tiny_moe")
    with pytest.raises(ConfigError, match="8 experts cannot be written as a Qwen3ForCausalLM, which has none"):
        args_to_hf_config(replace(args, family="qwen3"), torch.float32)
    with pytest.raises(ConfigError, match=r"MoE layers = \[0, 2, 3\] cannot be written as a MixtralForCausalLM"):
        args_to_hf_config(replace(args, family="mixtral", qk_norm=False), torch.float32)


def test_mixtral_8x7b_parameter_counts():
    """Mistral's published 46.7B total, 12.9B active."""
    args = flavor_args("mixtral_8x7B")
    with torch.device("meta"):
        model = Llama(args)
    assert (round(model.num_params() / 1e9, 2), round((model.num_params() - args.inactive_param_count()) / 1e9, 2)) \
        == (46.70, 12.88)


def test_the_30b_a3b_lora_config_plans_with_dry_run(capsys, monkeypatch):
    """train_configs/qwen3_30b_a3b_lora.toml on 8 x 80 GB before any download (the bundled tokenizer stands in): the
    plan fits; only the data and the weights are missing (exit 5)."""
    import re

    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", "8")
    cfg = parse_args(["--job.config_file", "train_configs/qwen3_30b_a3b_lora.toml", "--model.hf_assets_path",
                      "./assets/tokenizer"])
    assert dry_run(cfg) == 5
    out = capsys.readouterr().out
    # 30,532,122,624 of the model and 642,514,944 of adapters (rank 16 on q/k/v/o and on 96 expert groups)
    assert "model: qwen3 qwen3_30B_A3B, 31,174,637,568 parameters, 48 layers; transforms: lora" in out
    assert "dry run OK" in out
    assert float(re.search(r"largest peak ([\d.]+) GiB", out)[1]) < 80


@pytest.mark.parametrize("argv, message", [
    (["--model.flavor", "tiny", "--model.router_aux_loss_coef", "0.01"], "'model.router_aux_loss_coef' = 0.01 has no "
     "effect: flavor 'tiny' is a dense llama model without experts; drop the setting"),
    (["--model.flavor", "tiny_moe", "--model.router_aux_loss_coef", "-1"], "'model.router_aux_loss_coef' = -1.0 must "
     "be at least 0 (0 turns the load-balancing loss off)"),
])
def test_router_aux_loss_coef_is_refused_where_it_means_nothing(argv, message):
    from titan_lite.config import parse_args
    from titan_lite.errors import ConfigError
    from titan_lite.job.plan import build_model_args

    with pytest.raises(ConfigError) as exc:
        build_model_args(parse_args(argv), vocab_size=None)
    assert str(exc.value) == message
