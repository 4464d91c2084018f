"""LoRA on an MoE layer's experts: grouped factors applied as two grouped matmuls equal each expert's merged weight,
the PEFT export of a trained run loads with peft on transformers' Qwen3MoeForCausalLM and gives the merged model's
logits, every target_modules entry reports what it matched, and what LoRA on experts lacks is one line."""

import json
from pathlib import Path

import pytest
import torch

from titan_lite.config import parse_args
from titan_lite.errors import ConfigError
from titan_lite.models.flavors import flavor_args
from titan_lite.models.parts.moe import MoE
from titan_lite.transforms.lora.experts import LoRAGroupedExperts, adapted_experts, merge_expert_adapters
from titan_lite.transforms.lora.options import LoraOptions


def lora_section(*overrides: str):
    return parse_args(["--model.converters", "lora", *overrides]).lora


def randomised_moe(seed: int = 0) -> MoE:
    """tiny_moe's MoE block with adapted experts (gate_up and down, rank 4, scale 2) and every tensor random."""
    torch.manual_seed(seed)
    moe = MoE(flavor_args("tiny_moe"))
    moe.experts = adapted_experts(moe.experts, {"gate_up": (4, 2.0), "down": (4, 2.0)})
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.1 * torch.randn_like(p))
    return moe


def test_grouped_adapters_equal_each_experts_merged_weight_forward_and_backward():
    """y = W_e x + s B_e (A_e x) through two grouped matmuls per group equals x through the merged W_e + s B_e A_e
    (merge_expert_adapters: the export's merge); the adapters' gradients equal those of the explicit product."""
    moe = randomised_moe()
    x = torch.randn(2, 16, 64)
    out = moe(x)
    assert isinstance(moe.experts, LoRAGroupedExperts) and not any(
        p.shape == moe.experts.w1.shape for n, p in moe.experts.named_parameters() if "lora" in n)
    grads = torch.autograd.grad(out.square().sum(), [moe.experts.gate_up.lora_a, moe.experts.down.lora_b])

    state = {f"layers.0.moe.experts.{n}": p.detach() for n, p in moe.experts.named_parameters()}
    merged = merge_expert_adapters(state, {"layers.0.moe.experts.gate_up": 2.0, "layers.0.moe.experts.down": 2.0})
    assert sorted(merged) == ["layers.0.moe.experts.w1", "layers.0.moe.experts.w2", "layers.0.moe.experts.w3"]
    plain = MoE(flavor_args("tiny_moe"))
    plain.load_state_dict({**{n: p for n, p in moe.state_dict().items() if not n.startswith("experts.")},
                           **{f"experts.{n.rsplit('.', 1)[1]}": t for n, t in merged.items()}})
    torch.testing.assert_close(out, plain(x), atol=1e-5, rtol=1e-5)

    # explicit per-expert adapter products, one token at a time
    e = moe.experts
    a1, b1 = e.gate_up.lora_a, e.gate_up.lora_b
    probs, weights, experts = moe.router(x.reshape(-1, 64))
    rows = []
    for t, token in enumerate(x.reshape(-1, 64)):
        total = 0
        for k in range(2):
            j = int(experts[t, k])
            update = 2.0 * b1[j] @ (a1[j] @ token)
            gate, up = e.w1[j] @ token + update[:32], e.w3[j] @ token + update[32:]
            h = torch.nn.functional.silu(gate) * up
            total = total + weights[t, k] * (e.w2[j] @ h + 2.0 * e.down.lora_b[j] @ (e.down.lora_a[j] @ h))
        rows.append(total)
    reference = torch.stack(rows).view(2, 16, 64)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    expected = torch.autograd.grad(reference.square().sum(), [a1, e.down.lora_b])
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_each_target_reports_what_it_matched():
    args = flavor_args("tiny_moe")  # layers 0, 2, 3 MoE; layer 1 dense
    options = LoraOptions.from_section(lora_section("--lora.target_modules", "w1,experts,all-linear"))
    assert options.match_report(args) == [
        "lora: target 'w1' matched 1 linear modules (12,288 parameters) and 0 expert groups (0 expert parameters)",
        "lora: target 'experts' matched 0 linear modules (0 parameters) and 6 expert groups (147,456 expert "
        "parameters)",
        "lora: target 'all-linear' matched 19 linear modules (135,168 parameters) and 6 expert groups (147,456 "
        "expert parameters)"]


@pytest.mark.parametrize("flavor, targets, message", [
    ("debugmodel_moe", "wq,gate_proj", "'lora.target_modules' entry 'gate_proj' matches no module of this model; every "
     "layer's feed-forward is routed experts: adapt them with 'experts' (or 'experts.gate_up_proj', "
     "'experts.down_proj')"),
    ("tiny", "experts", "'lora.target_modules' entry 'experts' matches no module of this model; it has no MoE layer"),
])
def test_a_target_matching_nothing_is_refused(flavor, targets, message):
    options = LoraOptions.from_section(lora_section("--lora.target_modules", targets))
    with pytest.raises(ConfigError) as exc:
        options.match_report(flavor_args(flavor))
    assert str(exc.value) == message


@pytest.mark.parametrize("overrides, message", [
    (["--lora.target_modules", "experts.w1"], "'lora.target_modules' has 'experts.w1': an expert's gate and up "
     "projections are adapted together (one A per expert, as PEFT adapts transformers' fused gate_up_proj); name "
     "'experts.gate_up_proj', 'experts.down_proj' or 'experts'"),
    (["--lora.target_modules", "experts", "--lora.use_dora"], "'lora.use_dora' = True: LoRA on experts "
     "('lora.target_modules' names experts) does not support DoRA's per-row magnitude of a grouped weight; turn it "
     "off or adapt only attention and dense projections"),
    (["--lora.target_modules", "experts", "--lora.base_dtype", "nf4"], "'lora.base_dtype' = 'nf4': LoRA on experts "
     "('lora.target_modules' names experts) does not support an NF4 base (no NF4 grouped matmul: the experts, most "
     "of the model, would stay unquantized); turn it off or adapt only attention and dense projections"),
])
def test_what_lora_on_experts_lacks_is_one_line(overrides, message):
    from titan_lite.parallel.parallel_dims import ParallelDims
    from titan_lite.transforms.lora.transform import LoraTransform

    with pytest.raises(ConfigError) as exc:
        cfg = parse_args(["--model.converters", "lora", *overrides])
        LoraTransform(cfg).check(flavor_args("tiny_moe"), ParallelDims(1, 1, 1, 1, 1, 1))
    assert str(exc.value) == message


# ------------------------------------------------------------------------------------------ a run and PEFT


@pytest.mark.slow
def test_trained_expert_adapters_load_with_peft_and_equal_the_merged_export(tmp_path):
    """run_train.sh trains LoRA on attention (wq, wv) and the experts of tiny_moe; its PEFT adapter, loaded by peft
    on transformers' Qwen3MoeForCausalLM of the written base, gives the logits of the run's merged export (per-expert
    HF keys), loaded by transformers; the adapter holds PEFT's fused-expert tensors."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors import safe_open

    from tests.integration.harness import run_train

    run = run_train(["--model.flavor", "tiny_moe", "--training.steps", "3", "--model.converters", "lora",
                     "--lora.target_modules", "wq,wv,experts", "--lora.rank", "4", "--checkpoint.enable",
                     "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "float32"], tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    assert "lora: target 'experts' matched 0 linear modules (0 parameters) and 6 expert groups (147,456 expert " \
           "parameters)" in run.output
    folder = tmp_path / "checkpoint"
    adapter = folder / "step-3-adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    layer0 = "base_model.model.model.layers.0.mlp.experts."
    assert shapes[layer0 + "base_layer.lora_A.weight"] == [8 * 4, 64]  # gate_up: E x r rows over dim
    assert shapes[layer0 + "base_layer.lora_B.weight"] == [2 * 32, 4 * 8]
    assert shapes[layer0 + "lora_A.weight"] == [8 * 4, 32] and shapes[layer0 + "lora_B.weight"] == [64, 4 * 8]
    assert not any(".layers.1.mlp.experts" in k for k in shapes)  # layer 1 is dense

    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(3))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder / "step-3-base-hf", dtype=torch.float32)
    with torch.no_grad():
        before = base(tokens).logits
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder / "step-3-hf", dtype=torch.float32).eval()
    with torch.no_grad():
        got, want = with_adapter(tokens).logits, merged(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - before).abs().max() > 1e-4  # the adapters changed the model
    assert any(k.startswith("model.layers.0.mlp.experts.7.") for k in _keys(folder / "step-3-hf"))


def _keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())
