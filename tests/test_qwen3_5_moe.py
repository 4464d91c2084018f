"""Qwen3.5-MoE against transformers' Qwen3_5MoeForCausalLM on random small models with wide weights: equal logits
(from transformers' per-expert save and from a release's fused experts), greedy generation, the HF round trip,
packed documents equal to one document per row, the load-balancing loss equal to load_balancing_loss_func, and bad
input refused in one line."""

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func  # noqa: E402

from tests.hf_oracle import check_packed_equals_alone, load_titan  # noqa: E402
from tests.test_qwen3_5 import SMALL, tokens, widened  # noqa: E402
from titan_lite.checkpoint.hf import check_hf_folder, write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.generate.decode import GenerationConfig, generate  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config  # noqa: E402
from titan_lite.models.parts.moe import MoE  # noqa: E402

MOE = {**{k: v for k, v in SMALL.items() if k != "intermediate_size"}, "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "router_aux_loss_coef": 0.01}


def hf_moe(**overrides) -> Qwen3_5MoeForCausalLM:
    """A small model whose router and shared-expert gate are drawn wide too (a sharp routing, gates far from 0.5)."""
    torch.manual_seed(0)
    model = widened(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**MOE, **overrides})).eval().float())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    hf_moe().save_pretrained(folder)
    return folder


def test_logits_equal_transformers(saved):
    ids = tokens()
    args = load_titan(saved).args
    assert (args.family, args.n_experts, args.moe_top_k, args.moe_ffn_dim, args.moe_shared_ffn_dim,
            args.moe_layers) == ("qwen3_5_moe", 8, 2, 32, 48, [0, 1, 2, 3])
    with torch.no_grad():
        expected = Qwen3_5MoeForCausalLM.from_pretrained(saved).eval()(ids).logits
        ours = load_titan(saved)(ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_a_release_folder_with_fused_experts_loads_its_text_model(saved, tmp_path, caplog):
    """A release folder: the config under text_config (model_type qwen3_5_moe), the text tensors under
    model.language_model., the experts fused (gate_up_proj [E, 2 x hidden, dim], down_proj [E, dim, hidden]) and
    vision and mtp.* tensors beside them, skipped and said."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "release"
    folder.mkdir()
    text = json.loads((saved / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "architectures":
                                                    ["Qwen3_5MoeForConditionalGeneration"], "text_config": text}))
    flat = load_file(saved / "model.safetensors")
    fused = {}
    for layer in range(MOE["num_hidden_layers"]):
        experts = f"model.layers.{layer}.mlp.experts"
        per_expert = {part: torch.stack([flat.pop(f"{experts}.{j}.{part}_proj.weight") for j in range(8)])
                      for part in ("gate", "up", "down")}
        fused[f"{experts}.gate_up_proj"] = torch.cat([per_expert["gate"], per_expert["up"]], dim=1)
        fused[f"{experts}.down_proj"] = per_expert["down"]
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in {**flat, **fused}.items()}
    tensors |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(4, 4)}
    save_file(tensors, folder / "model.safetensors")
    ids = tokens()
    for each in (folder, saved):  # the launch's header-only check of the folder, fused and per expert
        check_hf_folder(str(each), load_titan(saved).args)
    with caplog.at_level("INFO", logger="titan_lite"), torch.no_grad():
        torch.testing.assert_close(load_titan(folder)(ids), load_titan(saved)(ids), rtol=0, atol=0)
    assert "skipping 1 tensors of the vision encoder" in caplog.text
    assert "skipping 1 tensors of the multi-token prediction head" in caplog.text


def test_hf_round_trip_loads_in_transformers_with_equal_logits(saved, tmp_path):
    """The export writes the experts fused, as the releases store them; transformers loads it, and so does
    titan_lite."""
    from safetensors import safe_open

    model = load_titan(saved)
    out = tmp_path / "export"
    write_hf_folder(model.state_dict(), model.args, str(out), torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3_5_moe_text", ["Qwen3_5MoeForCausalLM"])
    with safe_open(out / "model.safetensors", "pt") as written:
        assert list(written.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()) == [8, 64, 64]
    ids = tokens()
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(reloaded) is Qwen3_5MoeForCausalLM
        torch.testing.assert_close(reloaded(ids).logits, model(ids), rtol=0, atol=1e-5)
        torch.testing.assert_close(load_titan(out)(ids), model(ids), rtol=0, atol=0)
    assert args_from_hf_config(config) == model.args


def test_greedy_generation_of_64_tokens_equals_transformers(saved):
    prompts = tokens(2, 70, seed=4)
    new = 64
    with torch.no_grad():
        expected = Qwen3_5MoeForCausalLM.from_pretrained(saved).eval().generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0)[:, 70:].tolist()
    got = generate(load_titan(saved), prompts.tolist(), GenerationConfig(max_new_tokens=new), torch.device("cpu"))
    assert got == expected and got[0] != got[1]


def test_packed_documents_equal_one_document_per_row(saved):
    """Documents of 13, 29 and 22 tokens (none a multiple of the 16-step chunk): logits, loss and every gradient
    (router, experts and shared expert included) equal each document alone; gradients within 5e-6 of ones up to ~5
    (float32 sums in another order: 4e-7 of the largest)."""
    model = load_titan(saved, linear_chunk_size=16, attn_mask_type="block_causal")
    check_packed_equals_alone(model, [tokens(1, n, seed=10 + i)[0] for i, n in enumerate([13, 29, 22])],
                              grad_atol=5e-6)


def test_the_load_balancing_loss_is_transformers_per_sequence_and_layer(saved):
    """Training records each (sequence, MoE layer)'s load_balancing_loss_func of transformers' own router logits;
    transformers' aux_loss pools the same logits."""
    ids = tokens(2, 40)
    with torch.no_grad():
        theirs = Qwen3_5MoeForCausalLM.from_pretrained(saved).eval()(ids, output_router_logits=True)
    per_sequence = [load_balancing_loss_func((layer[b * 40:(b + 1) * 40],), 8, 2)
                    for layer in theirs.router_logits for b in range(2)]
    torch.testing.assert_close(theirs.aux_loss, load_balancing_loss_func(theirs.router_logits, 8, 2), rtol=0, atol=0)
    model = load_titan(saved).train()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.aux_loss_scale = MOE["router_aux_loss_coef"]
        moe.reset_stats()
    model(ids)
    torch.testing.assert_close(sum(m.aux_loss_sum for m in moes), sum(per_sequence), rtol=0, atol=1e-5)
    assert model.args.router_aux_loss_coef == MOE["router_aux_loss_coef"]


@pytest.mark.parametrize("overrides, message", [
    ({"norm_topk_prob": False}, "'norm_topk_prob' is False"),
    ({"shared_expert_intermediate_size": 0}, "'shared_expert_intermediate_size' is 0; expected a positive width"),
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok' is 9; expected 1 to num_experts = 8"),
    ({"mlp_only_layers": [1]}, "'mlp_only_layers' is [1]"),
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
     "layer_types[1] is 'mamba'; known layer types:"),
])
def test_bad_config_is_one_line(saved, overrides, message):
    cfg = {**json.loads((saved / "config.json").read_text()), **overrides}
    with pytest.raises(ConfigError, match="^config.json: ") as err:
        args_from_hf_config(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_debug_flavor_initialises_and_exports_to_transformers(tmp_path):
    args = replace(flavor_args("debugmodel_qwen3_5_moe"), max_seq_len=128)
    model = Llama(args)
    model.init_weights(seed=0)
    write_hf_folder(model.state_dict(), args, str(tmp_path / "hf"), torch.float32)
    ids = torch.randint(0, args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
        torch.testing.assert_close(model.eval()(ids), theirs, rtol=0, atol=1e-5)


def test_reap_removes_the_weak_experts_with_their_router_rows_and_keeps_the_shared_expert(tmp_path, capsys):
    """scripts/prune.py --method reap on a Qwen3.5-MoE whose experts differ only in output scale (test_reap's
    SCALES, a narrow router): exactly the weak ones go in every layer, with their router rows; the shared expert and
    its gate stay as they were; transformers loads the smaller folder, with titan_lite's logits."""
    import shutil

    from tests.test_hf import load_script
    from tests.test_reap import SCALES, STRONG, TEXT, safetensors_of

    model = hf_moe(vocab_size=2048)  # the bundled tokenizer's vocabulary
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            # a narrow router, as test_reap's: gate weights near 1/k for every expert, so the scale decides
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=generator) * 0.02)
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(experts.gate_up_proj[:1].expand_as(experts.gate_up_proj))
            experts.down_proj.copy_(experts.down_proj[:1] * torch.tensor(SCALES)[:, None, None])
    folder, out = tmp_path / "scaled", tmp_path / "reap"
    model.save_pretrained(folder)
    shutil.copy2(TEXT.parents[5] / "assets/tokenizer/tokenizer.model", folder)
    argv = ["--hf_assets_path", str(folder), "--output_dir", str(out), "--method", "reap", "--expert_ratio", "0.5",
            "--calib_path", str(TEXT), "--nsamples", "4", "--seq_len", "32"]
    assert load_script("prune").main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"pruned model written to {out}: 8 -> 4 experts in each of 4 MoE layers (reap);")
    report = json.loads((out / "reap_report.json").read_text())
    assert {layer: r["kept"] for layer, r in report["layers"].items()} == {str(i): STRONG for i in range(4)}
    before, after = safetensors_of(folder), safetensors_of(out)
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp"
        assert torch.equal(after[f"{prefix}.gate.weight"], before[f"{prefix}.gate.weight"][STRONG])
        gate_up = torch.stack([torch.cat([before[f"{prefix}.experts.{j}.{proj}_proj.weight"]
                                          for proj in ("gate", "up")]) for j in STRONG])
        assert torch.equal(after[f"{prefix}.experts.gate_up_proj"], gate_up)
        for name in ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                     "shared_expert.down_proj.weight", "shared_expert_gate.weight"):
            assert torch.equal(after[f"{prefix}.{name}"], before[f"{prefix}.{name}"])
    ids = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        pruned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert pruned.config.num_experts == 4
        torch.testing.assert_close(load_titan(out)(ids), pruned(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("flavor, total, active", [
    ("qwen3_5_35B_A3B", 34.66e9, 3.45e9), ("qwen3_5_122B_A10B", 122.1e9, 9.77e9),
    ("qwen3_5_397B_A17B", 396.3e9, 17.35e9)])
def test_the_published_flavors_count_the_published_parameters_and_match_their_release_config(flavor, total, active,
                                                                                           tmp_path):
    """families_2026.md's totals and active counts (to their printed digits); a release-shaped config.json (the text
    model under text_config) names the flavor."""
    from titan_lite.models.hf.config import args_to_hf_config, flavor_of_hf_config

    args = flavor_args(flavor)
    with torch.device("meta"):
        count = Llama(args).num_params()
    digits = 2 if total < 100e9 else 1
    assert (round(count / 1e9, digits), round((count - args.inactive_param_count()) / 1e9, 2)) == (
        round(total / 1e9, digits), round(active / 1e9, 2))
    release = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": args_to_hf_config(args, torch.bfloat16), "vision_config": {"depth": 27}}
    (tmp_path / "config.json").write_text(json.dumps(release))
    assert flavor_of_hf_config(tmp_path / "config.json") == flavor
