"""REAP expert pruning: the scores equal a direct computation of the formula, a model whose experts differ only in
output scale loses exactly the weak ones (scripts/prune.py --method reap writes a smaller Qwen3-MoE folder that
transformers loads, experts renumbered, router rows kept with them), and bad input is one line."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.test_hf import load_script
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.parts.moe import MoE
from titan_lite.transforms.structured.reap import ExpertObserver, experts_to_keep, scores_of

TEXT = Path(__file__).resolve().parents[1] / "titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt"


@torch.no_grad()
def direct_scores(model: Llama, tokens: torch.Tensor) -> dict[int, tuple[list[float], list[float]]]:
    """Per MoE layer: (REAP score, routed share) of each expert, token by token: the layer's input x, its top-k
    experts j with gate weights g_j(x), the expert's own SwiGLU output f_j(x); mean of g ||f|| over j's tokens."""
    inputs = {}
    hooks = [block.moe.register_forward_pre_hook(lambda m, a, i=int(key): inputs.__setitem__(i, a[0]))
             for key, block in model.layers.items() if block.moe_enabled]
    model(tokens)
    for hook in hooks:
        hook.remove()
    out = {}
    for layer, x in inputs.items():
        moe = model.layers[str(layer)].moe
        e = moe.experts
        sums, counts = [0.0] * 8, [0] * 8
        for token in x.reshape(-1, x.shape[-1]):
            probs = torch.softmax(moe.router.gate.weight @ token, dim=-1)
            top, ids = probs.topk(2)
            for g, j in zip(top / top.sum(), ids.tolist(), strict=True):
                f = e.w2[j] @ (F.silu(e.w1[j] @ token) * (e.w3[j] @ token))
                sums[j] += float(g * f.norm())
                counts[j] += 1
        out[layer] = ([s / max(c, 1) for s, c in zip(sums, counts, strict=True)],
                      [c / sum(counts) for c in counts])
    return out


def test_scores_equal_a_direct_computation_of_the_formula():
    torch.manual_seed(0)
    model = Llama(flavor_args("tiny_moe")).eval()
    model.init_weights(seed=4)
    with torch.no_grad():
        for block in model.layers.values():  # routing far from uniform, experts of different strength
            if block.moe_enabled:
                block.moe.router.gate.weight.mul_(20.0)
                block.moe.experts.w2.mul_(torch.linspace(0.5, 4.0, 8)[:, None, None])
    tokens = torch.randint(0, 2048, (3, 20), generator=torch.Generator().manual_seed(1))
    observer = ExpertObserver([model], torch.device("cpu"))
    with torch.no_grad():
        model(tokens)
    observer.close()
    expected = direct_scores(model, tokens)
    assert sorted(expected) == [0, 2, 3]
    for kind, column in (("reap", 0), ("frequency", 1)):
        scores = scores_of(observer.sums, kind)
        for layer, values in scores.items():
            torch.testing.assert_close(torch.tensor(values), torch.tensor(expected[layer][column]), atol=1e-6,
                                       rtol=1e-5)
    counts = [c for layer in expected for c in expected[layer][1]]
    assert max(counts) > 1.5 * min(counts)  # the frequency scores are not all alike


def test_experts_to_keep_takes_the_highest_and_breaks_ties_by_index():
    assert experts_to_keep({0: [0.3, 0.1, 0.3, 0.9], 5: [1.0, 2.0, 0.0, 0.0]}, 2) == {0: [0, 3], 5: [0, 1]}


# ------------------------------------------------------------------------------------------ the script

SCALES = [8.0, 0.5, 4.0, 0.25, 2.0, 16.0, 1.0, 32.0]  # weak: experts 1, 3, 4, 6
STRONG = [0, 2, 5, 7]


@pytest.fixture(scope="module")
def scaled_folder(tmp_path_factory) -> Path:
    """transformers' random Qwen3-MoE whose experts, in each MoE layer, are one expert with its down projection
    scaled by SCALES: they differ only in output scale."""
    import shutil

    from tests.helpers import hf_family_model

    folder = tmp_path_factory.mktemp("scaled")
    model = hf_family_model("qwen3_moe")
    with torch.no_grad():
        for layer in (0, 2):
            experts = model.model.layers[layer].mlp.experts
            experts.gate_up_proj.copy_(experts.gate_up_proj[:1].expand_as(experts.gate_up_proj))
            experts.down_proj.copy_(experts.down_proj[:1] * torch.tensor(SCALES)[:, None, None])
    model.save_pretrained(folder)
    shutil.copy2(Path(__file__).resolve().parents[1] / "assets/tokenizer/tokenizer.model", folder)
    return folder


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_reap_removes_exactly_the_weak_experts_and_writes_a_smaller_qwen3_moe(scaled_folder, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "reap"
    argv = ["--hf_assets_path", str(scaled_folder), "--output_dir", str(out), "--method", "reap", "--expert_ratio",
            "0.5", "--calib_path", str(TEXT), "--nsamples", "8", "--seq_len", "32"]
    assert load_script("prune").main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"pruned model written to {out}: 8 -> 4 experts in each of 2 MoE layers (reap);")
    report = json.loads((out / "reap_report.json").read_text())
    assert {layer: r["kept"] for layer, r in report["layers"].items()} == {"0": STRONG, "2": STRONG}
    assert report["experts"] == {"before": 8, "after": 4, "num_experts_per_tok": 2}
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["mlp_only_layers"]) == ("qwen3_moe", 4, [1])
    before, after = safetensors_of(scaled_folder), safetensors_of(out)
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp"
        assert torch.equal(after[f"{prefix}.gate.weight"], before[f"{prefix}.gate.weight"][STRONG])
        for new, old in enumerate(STRONG):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(after[f"{prefix}.experts.{new}.{proj}.weight"],
                                   before[f"{prefix}.experts.{old}.{proj}.weight"])
        assert f"{prefix}.experts.4.gate_proj.weight" not in after
    assert torch.equal(after["model.layers.1.mlp.gate_proj.weight"], before["model.layers.1.mlp.gate_proj.weight"])
    pruned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert pruned.config.num_experts == 4


def test_frequency_scores_the_share_of_routed_tokens(scaled_folder, tmp_path, capsys):
    out = tmp_path / "freq"
    argv = ["--hf_assets_path", str(scaled_folder), "--output_dir", str(out), "--method", "reap", "--expert_ratio",
            "0.25", "--expert_score", "frequency", "--calib_path", str(TEXT), "--nsamples", "4", "--seq_len", "32"]
    assert load_script("prune").main(argv) == 0
    report = json.loads((out / "reap_report.json").read_text())
    for layer in report["layers"].values():
        assert sum(layer["scores"]) == pytest.approx(1.0)
        assert len(layer["kept"]) == 6 and sorted(layer["kept"] + layer["removed"]) == list(range(8))
        assert min(layer["scores"][j] for j in layer["kept"]) >= max(layer["scores"][j] for j in layer["removed"])


@pytest.mark.parametrize("argv, message", [
    (["--expert_ratio", "0.9"], "error: --expert_ratio 0.9 leaves 1 of the 8 experts of each MoE layer, fewer than "
     "num_experts_per_tok = 2 (each token needs that many distinct experts)"),
    (["--expert_ratio", "0.5", "--flavor", "tiny", "--hf_assets_path", "assets/tokenizer"],
     "error: --method reap removes experts, but flavor 'tiny' is a dense llama model with none; use wanda, "
     "sparsegpt, taylor_structured or depth"),
    ([], "error: --method reap needs --expert_ratio R: the fraction of every MoE layer's experts removed"),
    (["--expert_ratio", "0.5", "--method", "wanda"], "error: --expert_ratio and --expert_score apply to --method reap, "
     "not wanda"),
    (["--method", "depth", "--remove_layers", "1"], "error: --method depth writes models whose feed-forwards are "
     "dense; this qwen3_moe model routes 2 layers to experts: remove experts with --method reap"),
])
def test_bad_reap_input_is_one_line(scaled_folder, tmp_path, capsys, argv, message):
    base = ["--hf_assets_path", str(scaled_folder), "--output_dir", str(tmp_path / "out"), "--method", "reap"]
    assert load_script("prune").main([*base, *argv]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [message]


def test_estimate_only_plans_the_scoring_pass(scaled_folder, capsys):
    argv = ["--hf_assets_path", str(scaled_folder), "--method", "reap", "--expert_ratio", "0.5", "--nsamples", "16",
            "--seq_len", "64", "--estimate_only"]
    assert load_script("prune").main(argv) == 0
    out = capsys.readouterr().out
    assert "2 MoE layers of 8 experts -> 4; REAP (reap), 16 x 64 calibration tokens" in out
    assert out.strip().splitlines()[-1].startswith("estimate: peak ")


def test_moe_module_count_matches_the_flavor():
    assert sum(isinstance(m, MoE) for m in Llama(flavor_args("tiny_moe")).modules()) == 3
