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
