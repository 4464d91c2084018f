"""Qwen3.5-MoE's transforms against transformers' Qwen3_5MoeForCausalLM and peft: LoRA on attention, the Gated
DeltaNet projections, the routed experts (PEFT's target_parameters on the fused gate_up_proj / down_proj) and the
gated shared expert (its 1-wide gate frozen) exported as a PEFT adapter that peft applies with the merged export's
logits; DoRA and QLoRA on every linear but the routed experts (which refuse both in one line)."""

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_lora_peft import load_with_peft, pretend_trained, titan_lora  # noqa: E402
from tests.test_qwen3_5_moe import hf_moe  # noqa: E402
from titan_lite.checkpoint.hf import gather_full_state_dict, write_hf_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 2048, (2, 30), generator=torch.Generator().manual_seed(5))
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
SHARED = ("gate_proj", "up_proj", "down_proj")  # the shared expert's, the only dense feed-forward linears
DENSE_TARGETS = ",".join(("q_proj", "k_proj", "v_proj", "o_proj", *DELTANET, *SHARED))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """tests/test_qwen3_5_moe.py's small wide-weight Qwen3.5-MoE (sharp router, shared-expert gates far from 0.5),
    vocabulary of the bundled tokenizer, saved by transformers with that tokenizer beside it."""
    folder = tmp_path_factory.mktemp("qwen3_5_moe_base")
    hf_moe(vocab_size=2048).save_pretrained(folder)
    shutil.copy2(ROOT / "assets" / "tokenizer" / "tokenizer.model", folder)
    return folder


def hf_logits(folder_or_model) -> torch.Tensor:
    model = folder_or_model
    if isinstance(folder_or_model, Path):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@torch.no_grad()
def pretend_trained_experts(model) -> None:
    """Expert adapters as after training: B non-zero (pretend_trained moves the linear adapters)."""
    gen = torch.Generator().manual_seed(4)
    for name, param in model.named_parameters():
        if ".moe.experts." in name and name.endswith(("lora_a", "lora_b")):
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def merged_folder(plan, model, base, out: Path) -> Path:
    merged_sd, args = next(iter(plan.transforms)).export_state_dict(gather_full_state_dict([model], torch.float32),
                                                                     plan.model_args)
    write_hf_folder(merged_sd, args, str(out), torch.float32, str(base))
    return out


@pytest.mark.parametrize("case", ["lora", "dora"])
def test_lora_loads_in_peft_with_the_merged_export_logits(case, base, tmp_path):
    """all-linear (LoRA) adapts attention, DeltaNet, the shared expert and the routed experts, never the router or
    shared_expert_gate; DoRA (no grouped form) the same less the routed experts, and its adapter loads back."""
    extra = ["--lora.use_dora", "--lora.target_modules", DENSE_TARGETS] if case == "dora" else []
    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", *extra, flavor="hf", assets=base)
    adapted = {name.split(".", 2)[-1] for name, m in model.named_modules() if hasattr(m, "lora_a")}
    shared = {f"moe.shared_expert.{w}" for w in ("w1", "w2", "w3")}
    dense = {f"attention.{w}" for w in ("wq", "wk", "wv", "wo", *DELTANET)} | shared
    assert adapted == (dense | {"moe.experts.gate_up", "moe.experts.down"} if case == "lora" else dense)
    pretend_trained(model)
    pretend_trained_experts(model)
    transform = next(iter(plan.transforms))
    transform.export([model], tmp_path, step=2)
    merged = merged_folder(plan, model, base, tmp_path / "merged")
    with torch.no_grad():
        ours = model(TOKENS)
    theirs_model = load_with_peft(base, tmp_path / "step-2-adapter")
    peft_targets = {n.rsplit(".", 1)[-1] for n, m in theirs_model.named_modules() if hasattr(m, "lora_A")}
    assert set(DELTANET) | set(SHARED) <= peft_targets and "shared_expert_gate" not in peft_targets
    theirs = hf_logits(theirs_model)
    assert (theirs - hf_logits(base)).abs().max() > 1e-2  # the adapter is applied
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(hf_logits(merged), theirs, atol=1e-5, rtol=0)
    if case == "dora":  # and back: the adapter read into titan_lite (shared-expert names included) gives our logits
        from titan_lite.transforms.lora.adapters import lora_settings_from_peft

        settings = lora_settings_from_peft(tmp_path / "step-2-adapter")
        argv = [f"--lora.{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in settings.items()]
        _, reloaded = titan_lora(base, *argv, flavor="hf", assets=base)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(TOKENS), ours, atol=1e-5, rtol=0)


def test_qlora_holds_every_frozen_linear_in_nf4_and_matches_its_merged_export(base, tmp_path):
    """QLoRA: attention, DeltaNet and shared-expert weights in NF4 (the routed experts, grouped weights, stay in the
    run's dtype; adapting them with an NF4 base is refused in one line); the merged export's logits equal the run's."""
    from titan_lite.transforms.nf4 import is_nf4

    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", "--lora.base_dtype", "nf4",
                             "--lora.target_modules", DENSE_TARGETS, flavor="hf", assets=base)
    deltanet, attention, moe = model.layers["0"].attention, model.layers["3"].attention, model.layers["0"].moe
    assert all(is_nf4(getattr(deltanet, name).weight) for name in DELTANET) and is_nf4(attention.wq.weight)
    assert all(is_nf4(getattr(moe.shared_expert, w).weight) for w in ("w1", "w2", "w3"))
    assert not is_nf4(moe.shared_expert_gate.weight) and not is_nf4(moe.experts.w1)
    pretend_trained(model)
    merged = merged_folder(plan, model, base, tmp_path / "merged")
    with torch.no_grad():
        ours = model(TOKENS)
    assert (ours - hf_logits(base)).abs().max() > 1e-2
    torch.testing.assert_close(hf_logits(merged), ours, atol=1e-5, rtol=0)


def prune_script():
    from tests.test_depth_prune import prune_script as script

    return script()


CALIBRATION = ["--nsamples", "4", "--seq_len", "32", "--batch_size", "2"]


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_wanda_and_sparsegpt_prune_every_dense_linear_and_transformers_loads_the_result(method, base, tmp_path):
    """Attention, DeltaNet and shared-expert projections at half their inputs; the router, shared_expert_gate and the
    routed experts (grouped weights, dense on every MoE family) as they were; transformers' logits equal ours."""
    from safetensors.torch import load_file

    from tests.hf_oracle import load_titan

    out = tmp_path / "pruned"
    assert prune_script().main(["--hf_assets_path", str(base), "--output_dir", str(out), "--method", method,
                                "--sparsity", "0.5", *CALIBRATION]) == 0
    weights = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    dense = {"gate", "shared_expert_gate"}
    linears = [k for k, v in weights.items() if v.dim() == 2 and ".layers." in k and k.split(".")[-2] not in dense]
    assert {k.split(".")[-2] for k in linears} == {"q_proj", "k_proj", "v_proj", "o_proj", *DELTANET, *SHARED}
    assert sum(".shared_expert." in k for k in linears) == 12
    for name in linears:
        assert (weights[name] == 0).float().mean().item() == pytest.approx(0.5, abs=0.02), name
    pruned, source = load_titan(out), load_titan(base).state_dict()
    untouched = [k for k in source if k.endswith(("router.gate.weight", "shared_expert_gate.weight", "experts.w1",
                                                  "experts.w2", "experts.w3"))]
    assert len(untouched) == 4 * 5
    for name in untouched:
        assert torch.equal(pruned.state_dict()[name], source[name]), name
    with torch.no_grad():
        torch.testing.assert_close(pruned(TOKENS), hf_logits(out), atol=1e-5, rtol=0)


def test_depth_pruning_drops_whole_blocks_with_their_experts(base, tmp_path):
    import json

    from tests.hf_oracle import load_titan

    out = tmp_path / "shallow"
    assert prune_script().main(["--hf_assets_path", str(base), "--output_dir", str(out), "--method", "depth",
                                "--layers_to_remove", "1", *CALIBRATION]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_experts"]) == (3, 8)
    assert config["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    source, shallow = load_titan(base), load_titan(out)
    assert torch.equal(shallow.layers["1"].moe.experts.w1, source.layers["2"].moe.experts.w1)
    assert torch.equal(shallow.layers["2"].moe.shared_expert_gate.weight,
                       source.layers["3"].moe.shared_expert_gate.weight)
    with torch.no_grad():
        del source.layers["1"]  # the source run without block 1 is the shallow model
        source.layers = torch.nn.ModuleDict({str(i): b for i, b in enumerate(source.layers.values())})
        torch.testing.assert_close(source(TOKENS), shallow(TOKENS), atol=1e-5, rtol=0)
        torch.testing.assert_close(hf_logits(out), shallow(TOKENS), atol=1e-5, rtol=0)


def test_what_stays_refused_is_one_line(base, tmp_path, capsys):
    """DoRA and an NF4 base on the routed experts (no grouped form), adapting shared_expert_gate, the structured
    methods that would cut the DeltaNet or the experts' widths, and the converters not checked here."""
    from titan_lite.config import parse_args
    from titan_lite.errors import ConfigError
    from titan_lite.job.plan import plan_job

    def refusal(*argv: str) -> str:
        cfg = parse_args(["--model.flavor", "hf", "--model.hf_assets_path", str(base), *argv])
        with pytest.raises(ConfigError) as err:
            plan_job(cfg, 1)
        assert "\n" not in str(err.value)
        return str(err.value)

    lora = ["--model.converters", "lora"]
    assert "'lora.use_dora' = True: LoRA on experts" in refusal(*lora, "--lora.use_dora")
    assert "'lora.base_dtype' = 'nf4': LoRA on experts" in refusal(*lora, "--lora.base_dtype", "nf4")
    assert "unknown module 'shared_expert_gate'" in refusal(*lora, "--lora.target_modules", "shared_expert_gate")
    assert refusal("--model.converters", "sheared").startswith(
        "'model.converters' has ['sheared'], which is not supported yet for Qwen3.5-MoE (its linear_attention layers "
        "and gated shared expert): only ['lora', 'prune'] have been checked there")
    code = prune_script().main(["--hf_assets_path", str(base), "--output_dir", str(tmp_path / "out"), "--method",
                                "taylor_structured", "--head_ratio", "0.5", *CALIBRATION])
    err = capsys.readouterr().err
    assert code == 2 and "taylor_structured writes models whose feed-forwards are dense" in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1
