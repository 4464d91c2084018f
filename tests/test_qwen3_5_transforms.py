"""Qwen3.5's transforms against transformers' Qwen3_5ForCausalLM and peft: LoRA on every linear (the Gated DeltaNet
projections too) exported as a PEFT adapter that peft applies to transformers' class with the merged export's logits,
QLoRA's NF4 base, Wanda and SparseGPT on every linear, depth pruning by block (the schedule follows the kept blocks),
and the structured methods that cannot cut a DeltaNet refused in one line."""

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_lora_peft import load_with_peft, pretend_trained, titan_lora  # noqa: E402
from tests.test_qwen3_5 import hf_model  # noqa: E402
from titan_lite.checkpoint.hf import gather_full_state_dict, write_hf_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(5))
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The small wide-weight Qwen3.5 of tests/test_qwen3_5.py (vocabulary of the bundled tokenizer), saved by
    transformers with that tokenizer beside it."""
    folder = tmp_path_factory.mktemp("qwen3_5_base")
    hf_model(vocab_size=2048).save_pretrained(folder)
    shutil.copy2(ROOT / "assets" / "tokenizer" / "tokenizer.model", folder)
    return folder


def hf_logits(folder_or_model) -> torch.Tensor:
    model = folder_or_model
    if isinstance(folder_or_model, Path):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("case", ["lora", "dora"])
def test_lora_on_every_linear_loads_in_peft_with_the_merged_export_logits(case, base, tmp_path):
    extra = ["--lora.use_dora"] if case == "dora" else []
    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", *extra, flavor="hf", assets=base)
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_a")}
    assert adapted == {"wq", "wk", "wv", "wo", "w1", "w2", "w3", *DELTANET}
    assert not hasattr(model.layers["3"].attention, "in_proj_qkv")  # layer 3 attends
    pretend_trained(model)
    transform = next(iter(plan.transforms))
    transform.export([model], tmp_path, step=2)
    merged_sd, args = transform.export_state_dict(gather_full_state_dict([model], torch.float32), plan.model_args)
    write_hf_folder(merged_sd, args, str(tmp_path / "merged"), torch.float32, str(base))
    with torch.no_grad():
        ours = model(TOKENS)
    theirs_model = load_with_peft(base, tmp_path / "step-2-adapter")
    peft_targets = {n.rsplit(".", 1)[-1] for n, m in theirs_model.named_modules() if hasattr(m, "lora_A")}
    assert set(DELTANET) <= peft_targets
    theirs = hf_logits(theirs_model)
    assert (theirs - hf_logits(base)).abs().max() > 1e-2  # the adapter is applied
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    torch.testing.assert_close(hf_logits(tmp_path / "merged"), theirs, atol=1e-4, rtol=0)


def test_qlora_holds_every_frozen_linear_in_nf4_and_matches_its_merged_export(base, tmp_path):
    from titan_lite.transforms.nf4 import is_nf4

    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", "--lora.base_dtype", "nf4",
                             flavor="hf", assets=base)
    deltanet, attention = model.layers["0"].attention, model.layers["3"].attention
    assert all(is_nf4(getattr(deltanet, name).weight) for name in DELTANET) and is_nf4(attention.wq.weight)
    pretend_trained(model)
    merged_sd, args = next(iter(plan.transforms)).export_state_dict(gather_full_state_dict([model], torch.float32),
                                                                     plan.model_args)
    write_hf_folder(merged_sd, args, str(tmp_path / "merged"), torch.float32, str(base))
    with torch.no_grad():
        ours = model(TOKENS)
    assert (ours - hf_logits(base)).abs().max() > 1e-2
    torch.testing.assert_close(hf_logits(tmp_path / "merged"), ours, atol=1e-4, rtol=0)


def prune_script():
    from tests.test_depth_prune import prune_script as script

    return script()


CALIBRATION = ["--nsamples", "4", "--seq_len", "32", "--batch_size", "2"]


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_wanda_and_sparsegpt_prune_every_linear_and_transformers_loads_the_result(method, base, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "pruned"
    assert prune_script().main(["--hf_assets_path", str(base), "--output_dir", str(out), "--method", method,
                                "--sparsity", "0.5", *CALIBRATION]) == 0
    weights = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    linears = [k for k, v in weights.items() if v.dim() == 2 and ".layers." in k]  # conv1d's weight is 3-D
    assert {k.split(".")[-2] for k in linears} >= set(DELTANET) | {"q_proj", "o_proj", "down_proj"}
    for name in linears:
        zeros = (weights[name] == 0).float().mean().item()
        assert zeros == pytest.approx(0.5, abs=0.02), name
    source = dict(load_file(next(base.glob("*.safetensors"))))
    assert not torch.equal(weights["model.layers.0.linear_attn.in_proj_qkv.weight"],
                           source["model.layers.0.linear_attn.in_proj_qkv.weight"])
    from tests.hf_oracle import load_titan

    with torch.no_grad():
        torch.testing.assert_close(load_titan(out)(TOKENS), hf_logits(out), atol=1e-5, rtol=0)


def test_depth_pruning_drops_whole_blocks_and_writes_the_kept_schedule(base, tmp_path):
    import json

    from tests.hf_oracle import load_titan

    out = tmp_path / "shallow"
    assert prune_script().main(["--hf_assets_path", str(base), "--output_dir", str(out), "--method", "depth",
                                "--layers_to_remove", "1", *CALIBRATION]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    assert config["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    source, shallow = load_titan(base), load_titan(out)
    assert torch.equal(shallow.layers["1"].attention.in_proj_qkv.weight,
                       source.layers["2"].attention.in_proj_qkv.weight)
    assert torch.equal(shallow.layers["2"].attention.wq.weight, source.layers["3"].attention.wq.weight)
    with torch.no_grad():
        del source.layers["1"]  # the source run without block 1 is the shallow model
        source.layers = torch.nn.ModuleDict({str(i): b for i, b in enumerate(source.layers.values())})
        torch.testing.assert_close(source(TOKENS), shallow(TOKENS), atol=1e-5, rtol=0)
        torch.testing.assert_close(hf_logits(out), shallow(TOKENS), atol=1e-5, rtol=0)


def test_taylor_structured_and_sheared_are_refused_in_one_line(base, tmp_path, capsys):
    code = prune_script().main(["--hf_assets_path", str(base), "--output_dir", str(tmp_path / "out"), "--method",
                                "taylor_structured", "--head_ratio", "0.5", *CALIBRATION])
    err = capsys.readouterr().err
    assert code == 2 and "not supported for Qwen3.5" in err and len(err.strip().splitlines()) == 1, err[-2000:]
    from titan_lite.config import parse_args
    from titan_lite.errors import ConfigError
    from titan_lite.job.plan import plan_job

    cfg = parse_args(["--model.flavor", "hf", "--model.hf_assets_path", str(base), "--model.converters", "sheared"])
    with pytest.raises(ConfigError, match=r"\['sheared'\], which is not supported yet for Qwen3.5"):
        plan_job(cfg, 1)
