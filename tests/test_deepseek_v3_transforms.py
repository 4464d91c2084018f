"""DeepSeek-V3's transforms against transformers' DeepseekV3ForCausalLM and peft, on the small wide-weight model of
tests/test_deepseek_v3.py: LoRA on every linear (the latent attention's down- and up-projections, o_proj, the dense
and shared-expert MLPs, the routed experts; the router and its correction bias frozen) and DoRA on the attention,
exported as PEFT adapters that peft applies to transformers' class with the merged export's logits; QLoRA's NF4
base; Wanda, SparseGPT and OWL on every linear with transformers loading the result; REAP removing exactly the weak
experts with their router rows and correction biases; what stays refused, one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.hf_oracle import load_titan  # noqa: E402
from tests.test_deepseek_v3 import hf_model  # noqa: E402
from tests.test_lora_peft import load_with_peft, pretend_trained, titan_lora  # noqa: E402
from tests.test_reap import SCALES, STRONG, TEXT, safetensors_of  # noqa: E402
from titan_lite.checkpoint.hf import gather_full_state_dict, write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 2048, (2, 30), generator=torch.Generator().manual_seed(5))
LATENT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "wo")
CALIBRATION = ["--nsamples", "4", "--seq_len", "32", "--batch_size", "2"]


def saved_with_tokenizer(folder: Path, model) -> Path:
    model.save_pretrained(folder)
    shutil.copy2(ROOT / "assets" / "tokenizer" / "tokenizer.model", folder)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """transformers' random DeepSeek-V3 (layer 0 dense, 8 experts in 4 groups, a shared expert; norms, router and
    correction bias far from their defaults), vocabulary of the bundled tokenizer."""
    return saved_with_tokenizer(tmp_path_factory.mktemp("deepseek_v3_base"), hf_model(vocab_size=2048))


def hf_logits(folder_or_model) -> torch.Tensor:
    model = folder_or_model
    if isinstance(folder_or_model, Path):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@torch.no_grad()
def experts_trained(model) -> None:
    """The routed experts' adapters as after training (pretend_trained moves the linear ones)."""
    gen = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        if ".moe.experts." in name and name.endswith("lora_b"):
            param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def export_and_compare(plan, model, base: Path, tmp_path: Path) -> dict:
    """The run's PEFT adapter on transformers' class and the merged export give titan_lite's logits; its config."""
    transform = next(iter(plan.transforms))
    transform.export([model], tmp_path, step=2)
    merged_sd, args = transform.export_state_dict(gather_full_state_dict([model], torch.float32), plan.model_args)
    write_hf_folder(merged_sd, args, str(tmp_path / "merged"), torch.float32, str(base))
    with torch.no_grad():
        ours = model(TOKENS)
    theirs = hf_logits(load_with_peft(base, tmp_path / "step-2-adapter"))
    assert (theirs - hf_logits(base)).abs().max() > 1e-2  # the adapter is applied
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(hf_logits(tmp_path / "merged"), theirs, atol=1e-5, rtol=0)
    return json.loads((tmp_path / "step-2-adapter" / "adapter_config.json").read_text())


def test_lora_on_every_linear_and_the_experts_loads_in_peft_with_the_merged_logits(base, tmp_path):
    """all-linear: the latent attention's five projections, layer 0's MLP, the shared experts and the routed experts
    adapted; the router and the correction bias frozen. The MLPs' adapters are target_parameters (peft rewrites
    gate_proj/up_proj/down_proj target_modules into the routed experts' on a deepseek_v3 model)."""
    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", flavor="hf", assets=base)
    adapted = {name.split(".", 1)[1] for name, m in model.named_modules() if hasattr(m, "lora_a")}
    assert {n for n in adapted if n.startswith("0.")} == {f"0.attention.{p}" for p in LATENT} | \
        {f"0.feed_forward.w{i}" for i in (1, 2, 3)}
    assert {n for n in adapted if n.startswith("1.")} == {f"1.attention.{p}" for p in LATENT} | \
        {f"1.moe.shared_experts.w{i}" for i in (1, 2, 3)} | {"1.moe.experts.gate_up", "1.moe.experts.down"}
    router = model.layers["1"].moe.router
    assert not router.gate.weight.requires_grad and not router.e_score_correction_bias.requires_grad
    pretend_trained(model)
    experts_trained(model)
    config = export_and_compare(plan, model, base, tmp_path)
    assert sorted(config["target_modules"]) == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
    assert "mlp.shared_experts.down_proj.weight" in config["target_parameters"]
    assert config["target_parameters"][-2:] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_lora_on_the_one_matrix_query_with_rotate_half_rope_loads_in_peft(tmp_path):
    """q_lora_rank null (titan_lite's attention.wq is HF q_proj) and rope_interleave false: the adapters' output rows
    on the query's and the rope key's rope channels are permuted like the weights' on export."""
    base = saved_with_tokenizer(tmp_path / "base", hf_model(vocab_size=2048, q_lora_rank=None, rope_interleave=False))
    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules",
                             "q_proj,kv_a_proj_with_mqa,o_proj", flavor="hf", assets=base)
    assert {n.split(".", 1)[1] for n, m in model.named_modules() if hasattr(m, "lora_a")} >= \
        {"0.attention.wq", "3.attention.kv_a_proj_with_mqa", "3.attention.wo"}
    pretend_trained(model)
    config = export_and_compare(plan, model, base, tmp_path / "run")
    assert sorted(config["target_modules"]) == ["kv_a_proj_with_mqa", "o_proj", "q_proj"]


def test_dora_on_the_latent_attention_loads_in_peft_and_on_the_mlps_is_refused(base, tmp_path):
    attention = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"
    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", "--lora.use_dora",
                             "--lora.target_modules", attention, flavor="hf", assets=base)
    pretend_trained(model)
    config = export_and_compare(plan, model, base, tmp_path)
    assert config["use_dora"] and "target_parameters" not in config
    with pytest.raises(ConfigError, match=r"^'lora.use_dora' on deepseek_v3's dense and shared-expert MLPs "
                                          r"\(layers.0.feed_forward.w1, ...\) has no PEFT form"):
        titan_lora(base, "--lora.use_dora", "--lora.target_modules", f"{attention},gate_proj", flavor="hf",
                   assets=base)


def test_qlora_holds_the_frozen_linears_in_nf4_and_matches_its_merged_export(base, tmp_path):
    """Every latent projection (its widths, 24 to 160, are all multiples of NF4's block of 64 elements per row
    group) and the dense and shared-expert MLPs in NF4; the routed experts are grouped weights, not NF4."""
    from titan_lite.transforms.nf4 import is_nf4

    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", "--lora.base_dtype", "nf4",
                             "--lora.target_modules", "q_b_proj,kv_b_proj,o_proj,down_proj", flavor="hf", assets=base)
    quantized = {n.split(".", 1)[1] for n, p in model.named_parameters() if is_nf4(p)}
    assert {n for n in quantized if n.startswith("1.")} == {f"1.attention.{p}.weight" for p in LATENT} | \
        {f"1.moe.shared_experts.w{i}.weight" for i in (1, 2, 3)}
    assert "0.feed_forward.w1.weight" in quantized and not is_nf4(model.layers["1"].moe.experts.w1)
    pretend_trained(model)
    merged_sd, args = next(iter(plan.transforms)).export_state_dict(gather_full_state_dict([model], torch.float32),
                                                                     plan.model_args)
    write_hf_folder(merged_sd, args, str(tmp_path / "merged"), torch.float32, str(base))
    with torch.no_grad():
        ours = model(TOKENS)
    assert (ours - hf_logits(base)).abs().max() > 1e-2
    torch.testing.assert_close(hf_logits(tmp_path / "merged"), ours, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ scripts/prune.py


def prune_script():
    from tests.test_depth_prune import prune_script as script

    return script()


@pytest.mark.parametrize("method", [["wanda"], ["sparsegpt"], ["wanda", "--layer_ratios", "owl"]],
                         ids=["wanda", "sparsegpt", "wanda_owl"])
def test_wanda_sparsegpt_and_owl_prune_every_linear_and_transformers_loads_the_result(method, base, tmp_path):
    """Every linear of the blocks (latent attention, the dense MLP, the shared experts) pruned as asked, calibrated
    through the latent attention and the group-routed experts; the router, its bias and the experts untouched."""
    from safetensors.torch import load_file

    out = tmp_path / "pruned"
    assert prune_script().main(["--hf_assets_path", str(base), "--output_dir", str(out), "--method", method[0],
                                "--sparsity", "0.5", *method[1:], *CALIBRATION]) == 0
    report = json.loads((out / "sparsity_report.json").read_text())
    weights = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    source = {k: v for f in base.glob("*.safetensors") for k, v in load_file(f).items()}
    linears = [k for k, v in weights.items() if v.dim() == 2 and ".layers." in k and "mlp.gate." not in k
               and ".mlp.experts." not in k]  # the folder holds one tensor per routed expert
    assert {k.split(".")[-2] for k in linears} == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                   "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert report["pruned_linears"]["count"] == len(linears) == 4 * 5 + 3 * 4  # 4 x latent, 1 dense + 3 shared MLPs
    zeros = [(weights[k] == 0).float().mean().item() for k in linears]
    if method[-1] == "owl":
        ratios = [layer["sparsity"] for layer in report["owl"]["layers"].values()]
        assert abs(sum(ratios) / 4 - 0.5) < 1e-9 and max(ratios) - min(ratios) > 0.01, ratios
    else:
        assert all(z == pytest.approx(0.5, abs=0.02) for z in zeros), zeros
    untouched = [k for k in source if k not in linears]
    assert any(k.endswith("e_score_correction_bias") for k in untouched)
    assert all(torch.equal(weights[k], source[k]) for k in untouched if k in weights)
    with torch.no_grad():
        torch.testing.assert_close(load_titan(out)(TOKENS), hf_logits(out), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def scaled_folder(tmp_path_factory) -> Path:
    """The base whose experts, in every MoE layer, are one expert with its down projection scaled by SCALES: they
    differ only in output scale (the router near uniform, its rows and correction biases still distinct)."""
    model = hf_model(vocab_size=2048, n_group=2, topk_group=1)  # keeping 4 leaves 2 per group
    scales = torch.tensor(SCALES)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            experts, gate = layer.mlp.experts, layer.mlp.gate
            gate.weight.mul_(0.05)
            gate.e_score_correction_bias.copy_(0.001 * torch.arange(8.0))
            experts.gate_up_proj.copy_(experts.gate_up_proj[:1].expand_as(experts.gate_up_proj))
            experts.down_proj.copy_(experts.down_proj[:1] * scales[:, None, None])
    return saved_with_tokenizer(tmp_path_factory.mktemp("scaled_deepseek_v3"), model)


def reap(folder: Path, out: Path, ratio: str) -> int:
    return prune_script().main(["--hf_assets_path", str(folder), "--output_dir", str(out), "--method", "reap",
                                "--expert_ratio", ratio, "--calib_path", str(TEXT), "--nsamples", "8", "--seq_len",
                                "32"])


def test_reap_removes_exactly_the_weak_experts_with_their_router_rows_and_biases(scaled_folder, tmp_path):
    out = tmp_path / "reap"
    assert reap(scaled_folder, out, "0.5") == 0
    report = json.loads((out / "reap_report.json").read_text())
    assert {layer: r["kept"] for layer, r in report["layers"].items()} == {str(i): STRONG for i in (1, 2, 3)}
    config = json.loads((out / "config.json").read_text())
    assert (config["n_routed_experts"], config["n_group"], config["topk_group"], config["first_k_dense_replace"]) == \
        (4, 2, 1, 1)
    before, after = safetensors_of(scaled_folder), safetensors_of(out)
    for layer in (1, 2, 3):
        prefix = f"model.layers.{layer}.mlp"
        for name in ("gate.weight", "gate.e_score_correction_bias"):
            assert torch.equal(after[f"{prefix}.{name}"], before[f"{prefix}.{name}"][STRONG]), name
        for new, old in enumerate(STRONG):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                key = f"{prefix}.experts.{{}}.{proj}.weight"
                if key.format(old) in before:
                    assert torch.equal(after[key.format(new)], before[key.format(old)]), key
        assert torch.equal(after[f"{prefix}.shared_experts.down_proj.weight"],
                           before[f"{prefix}.shared_experts.down_proj.weight"])
    with torch.no_grad():
        torch.testing.assert_close(load_titan(out)(TOKENS), hf_logits(out), atol=1e-5, rtol=0)


def test_reap_refuses_a_keep_count_the_expert_groups_cannot_hold(scaled_folder, tmp_path, capsys):
    """5 of 8 experts cannot be split into n_group = 2 equal groups: one line, nothing written."""
    assert reap(scaled_folder, tmp_path / "out", "0.375") == 2
    err = capsys.readouterr().err.strip()
    assert "--expert_ratio 0.375 leaves 5 of the 8 experts of each MoE layer, which n_group = 2 groups cannot " \
           "hold (n_group = 2 does not divide n_routed_experts = 5" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_float8_converts_every_block_linear_and_trains_close_to_fp32():
    """debugmodel_deepseek_v3 (widths all multiples of 16; emulated on CPU): the latent projections, o_proj, the
    dense and shared-expert MLPs become Float8Linear, the router (8 outputs) stays in high precision, the grouped
    experts are not linears; the logits are within float8's rounding of fp32 and every float8 weight gets a
    gradient."""
    from tests.test_deepseek_v3 import widened
    from tests.test_float8 import config, float8_names
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args
    from titan_lite.transforms import build_transforms

    (transform,) = build_transforms(config())
    args = flavor_args("debugmodel_deepseek_v3")
    reference, model = Llama(args), Llama(args)
    reference.init_weights(seed=3)
    widened(reference)
    transform.convert(model)
    model.load_state_dict(reference.state_dict())
    names = float8_names(model)
    assert len(names) == 4 * 5 + 3 * 4 and "layers.1.moe.shared_experts.w2" in names
    assert sorted(transform.kept) == ["layers.1.moe.router.gate", "layers.2.moe.router.gate",
                                      "layers.3.moe.router.gate", "output"]  # the head by the default filter_fqns
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    expected, got = reference(ids), model(ids)
    error = ((got - expected).norm() / expected.norm()).item()
    assert 1e-4 < error < 0.05, error
    got.float().logsumexp(-1).mean().backward()
    assert all(model.get_submodule(n).weight.grad is not None for n in names)


def test_what_is_not_checked_is_refused_in_one_line(base):
    from titan_lite.config import parse_args
    from titan_lite.job.plan import plan_job

    def plan(*argv: str, world: int = 1):
        return plan_job(parse_args(["--model.flavor", "hf", "--model.hf_assets_path", str(base), *argv]), world)

    with pytest.raises(ConfigError, match=r"\['sheared'\], which is not supported yet for DeepSeek-V3"):
        plan("--model.converters", "sheared")
    for converter in ("lora", "quantize.linear.float8"):  # tensor parallelism is not checked with them
        with pytest.raises(ConfigError, match=rf"^'model.converters' has '{converter}' with tensor parallelism, "
                                              "which is not checked yet on DeepSeek-V3's latent attention"):
            plan("--model.converters", converter, "--parallelism.tensor_parallel_degree", "2", world=2)


@pytest.mark.parametrize("removed, first_dense", [("2", 1), ("0", 0)])
def test_depth_pruning_drops_whole_blocks_and_keeps_first_k_dense_replace(removed, first_dense, base, tmp_path):
    """Removing a routed block keeps layer 0 dense (first_k_dense_replace 1); removing the dense block leaves every
    block routed (0). transformers loads the folder with the logits of the source run without that block."""
    out = tmp_path / "shallow"
    assert prune_script().main(["--hf_assets_path", str(base), "--output_dir", str(out), "--method", "depth",
                                "--layers_to_remove", removed, *CALIBRATION]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["first_k_dense_replace"]) == (3, first_dense)
    source, shallow = load_titan(base), load_titan(out)
    with torch.no_grad():
        del source.layers[removed]  # the source run without that block is the shallow model
        source.layers = torch.nn.ModuleDict({str(i): b for i, b in enumerate(source.layers.values())})
        torch.testing.assert_close(source(TOKENS), shallow(TOKENS), atol=1e-5, rtol=0)
        torch.testing.assert_close(hf_logits(out), shallow(TOKENS), atol=1e-5, rtol=0)
