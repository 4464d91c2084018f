"""The transforms on gpt-oss: REAP removes exactly the weak experts of a model whose experts differ only in output
scale (their biases and router rows and biases removed with them); LoRA on attention and experts (the biased,
clamped experts keep their function, the PEFT adapter in gpt-oss's names loads in peft on transformers'
GptOssForCausalLM with the merged logits); Wanda and SparseGPT on its projections; what stays refused, one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.test_gpt_oss import hf_model  # noqa: E402
from tests.test_hf import load_script  # noqa: E402
from tests.test_pruning import CALIBRATION, build, full_state, masked_linears, process_group  # noqa: E402, F401
from tests.test_reap import SCALES, STRONG, TEXT, safetensors_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scaled_folder(tmp_path_factory) -> Path:
    """transformers' random gpt-oss (vocabulary 2048: the bundled tokenizer) whose experts, in every layer, are one
    expert with its down projection and down bias scaled by SCALES: they differ only in output scale (the router
    near uniform, so each expert's routing weights are alike; its rows and biases still distinct)."""
    folder = tmp_path_factory.mktemp("scaled_gpt_oss")
    model = hf_model(experts_std=0.1, vocab_size=2048, num_local_experts=8)
    scales = torch.tensor(SCALES)
    with torch.no_grad():
        for layer in model.model.layers:
            experts, router = layer.mlp.experts, layer.mlp.router
            router.weight.mul_(0.05)
            router.bias.mul_(0.01)
            for name in ("gate_up_proj", "gate_up_proj_bias"):
                param = getattr(experts, name)
                param.copy_(param[:1].expand_as(param))
            experts.down_proj.copy_(experts.down_proj[:1] * scales[:, None, None])
            experts.down_proj_bias.copy_(experts.down_proj_bias[:1] * scales[:, None])
    model.save_pretrained(folder)
    shutil.copy2(REPO / "assets/tokenizer/tokenizer.model", folder)
    return folder


def test_reap_removes_exactly_the_weak_experts_with_their_biases(scaled_folder, tmp_path, capsys):
    out = tmp_path / "reap"
    argv = ["--hf_assets_path", str(scaled_folder), "--output_dir", str(out), "--method", "reap", "--expert_ratio",
            "0.5", "--calib_path", str(TEXT), "--nsamples", "8", "--seq_len", "32"]
    assert load_script("prune").main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"pruned model written to {out}: 8 -> 4 experts in each of 4 MoE layers (reap);")
    report = json.loads((out / "reap_report.json").read_text())
    assert {layer: r["kept"] for layer, r in report["layers"].items()} == {str(i): STRONG for i in range(4)}
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("gpt_oss", 4, 2)
    before, after = safetensors_of(scaled_folder), safetensors_of(out)
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp"
        for name in ("router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
                     "experts.down_proj", "experts.down_proj_bias"):
            assert torch.equal(after[f"{prefix}.{name}"], before[f"{prefix}.{name}"][STRONG]), name
    pruned = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(pruned).__name__ == "GptOssForCausalLM" and pruned.config.num_local_experts == 4


# ------------------------------------------------------------------------------------------ LoRA

def test_adapted_experts_keep_the_clamp_and_biases_and_equal_their_merged_weights():
    """LoRA on gpt-oss's experts: with zero B the experts compute the base function (clamped SwiGLU, biases); with
    random factors they equal the base experts holding the merged weights W + s B A."""
    from titan_lite.models.flavors import flavor_args
    from titan_lite.models.parts.moe import MoE
    from titan_lite.transforms.lora.experts import adapted_experts, merge_expert_adapters

    torch.manual_seed(0)
    moe = MoE(flavor_args("tiny_gpt_oss"))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(3.0 * torch.randn_like(p))  # wide: the clamp at 7 bites
    base = moe.experts
    adapted = adapted_experts(base, {"gate_up": (4, 2.0), "down": (4, 2.0)})
    adapted.load_state_dict(base.state_dict(), strict=False)
    x, counts = torch.randn(10, 64), torch.tensor([3, 0, 5, 2])
    with torch.no_grad():
        adapted.gate_up.lora_b.zero_(), adapted.down.lora_b.zero_()
        torch.nn.init.normal_(adapted.gate_up.lora_a), torch.nn.init.normal_(adapted.down.lora_a)
        assert float(base.project("w1", x, counts).max()) > base.limit
        torch.testing.assert_close(adapted(x, counts), base(x, counts), rtol=0, atol=0)
        torch.nn.init.normal_(adapted.gate_up.lora_b, std=0.1), torch.nn.init.normal_(adapted.down.lora_b, std=0.1)
        state = {f"layers.0.moe.experts.{k}": v for k, v in adapted.state_dict().items()}
        merged = merge_expert_adapters(state, {"layers.0.moe.experts.gate_up": 2.0, "layers.0.moe.experts.down": 2.0})
        base.load_state_dict({k.removeprefix("layers.0.moe.experts."): v for k, v in merged.items()})
        expected = base(x, counts)  # outputs of order 1e3: float32 rounding relative to that
        torch.testing.assert_close(adapted(x, counts), expected, rtol=0, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.slow
def test_lora_on_attention_and_experts_loads_in_peft_with_the_merged_logits(tmp_path):
    """run_train.sh trains LoRA on q/v (biased) and the experts of a gpt-oss folder; its PEFT adapter, in gpt-oss's
    names (target_parameters on the fused, interleaved gate_up_proj), loaded by peft on transformers'
    GptOssForCausalLM, gives the logits of the run's merged export."""
    peft = pytest.importorskip("peft")
    from tests.integration.harness import run_train

    folder = tmp_path / "base"
    hf_model(vocab_size=2048, experts_std=0.1).save_pretrained(folder)
    shutil.copy2(REPO / "assets/tokenizer/tokenizer.model", folder)
    run = run_train(["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--checkpoint.initial_load_in_hf",
                     "--checkpoint.initial_load_path", str(folder), "--training.steps", "3", "--training.seq_len",
                     "48", "--model.converters", "lora", "--lora.target_modules", "wq,wv,experts", "--lora.rank", "4",
                     "--lora.init", "gaussian", "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                     "--checkpoint.export_dtype", "float32"], tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    out = tmp_path / "run" / "checkpoint"
    config = json.loads((out / "step-3-adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(3))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(tokens).logits
    with_adapter = peft.PeftModel.from_pretrained(base, str(out / "step-3-adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "step-3-hf", attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        got, want = with_adapter(tokens).logits, merged(tokens).logits
    assert (got - before).abs().max() > 1e-4  # the adapters changed the model
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------ Wanda, SparseGPT

@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_wanda_and_sparsegpt_prune_the_attention_and_keep_sinks_and_biases(method):
    """On tiny_gpt_oss: every attention projection (biased) at half its inputs per row, calibrated through the
    sink attention and the routed experts; the sinks, biases, router and experts untouched."""
    dense, _ = build([], flavor="tiny_gpt_oss")
    before = full_state(dense.parts)
    built, _ = build(["--model.converters", "prune", "--pruning.method", method, *CALIBRATION], flavor="tiny_gpt_oss")
    pruned = full_state(built.parts)
    linears = dict(masked_linears(built.parts))
    assert sorted(linears) == sorted(f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wk", "wv", "wo"))
    for name in linears:
        w = pruned[f"{name}.weight"]
        if method == "wanda":  # Wanda: half of each row's inputs, the kept weights as they were
            assert (w == 0).sum(1).tolist() == [w.shape[1] // 2] * w.shape[0], name
            assert torch.equal(w[w != 0], before[f"{name}.weight"][w != 0])
        else:  # SparseGPT: half of the layer's weights, the kept ones updated
            assert int((w == 0).sum()) == w.numel() // 2 and not torch.equal(w, before[f"{name}.weight"]), name
    untouched = [n for n in before if not any(n == f"{m}.weight" for m in linears)]
    assert any(n.endswith("attention.sinks") for n in untouched) and any(n.endswith("wo.bias") for n in untouched)
    assert all(torch.equal(pruned[n], before[n]) for n in untouched if "mask" not in n)


# ------------------------------------------------------------------------------------------ QLoRA (NF4)

@pytest.mark.usefixtures("process_group")
def test_qlora_nf4_base_holds_the_attention_in_4_bits_and_computes_its_dequantized_model():
    """QLoRA on tiny_gpt_oss: the frozen attention projections (biased) stored as NF4, the sinks, biases and
    experts as they were; with B = 0 its logits are the dense model's holding the dequantized weights."""
    from titan_lite.models.decoder import Llama
    from titan_lite.transforms.lora.qlora import dense_state_dict
    from titan_lite.transforms.nf4.quantize import is_nf4

    built, plan = build(["--model.converters", "lora", "--lora.base_dtype", "nf4", "--lora.target_modules",
                         "wq,wv,wo"], flavor="tiny_gpt_oss")
    model = built.parts[0].eval()
    quantized = sorted(n for n, p in model.named_parameters() if is_nf4(p))
    assert quantized == sorted(f"layers.{i}.attention.{w}.weight" for i in range(4) for w in ("wq", "wk", "wv", "wo"))
    dense = Llama(plan.model_args).eval()
    state = {n: t for n, t in dense_state_dict(model.state_dict()).items() if not n.endswith(("lora_a", "lora_b"))}
    dense.load_state_dict(state)
    ids = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), dense(ids), rtol=0, atol=1e-5)
