"""gpt-oss before the GPUs are rented: the published flavors' parameter counts, DRY_RUN's memory plan counting the
eager sink attention (against the measured peak of a real CPU step) and the MoE, and the shipped LoRA recipe
planned."""

import re

import pytest
import torch

from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args


@pytest.mark.parametrize("flavor, total, active", [("gpt_oss_20b", 20.91, 3.61), ("gpt_oss_120b", 116.83, 5.13)])
def test_the_published_flavors_have_the_published_counts(flavor, total, active):
    """OpenAI's model card: 20.9B / 3.6B active and 116.8B / 5.1B active (active counts the unembedding, not the
    embedding)."""
    args = flavor_args(flavor)
    with torch.device("meta"):
        model = Llama(args)
    params = model.num_params()
    used = params - args.inactive_param_count() - model.tok_embeddings.weight.numel()
    print(f"{flavor}: {params:,} parameters, {used:,} active")
    assert (round(params / 1e9, 2), round(used / 1e9, 2)) == (total, active)
    assert (args.dim, args.head_dim, args.n_heads, args.n_kv_heads, args.vocab_size, args.sliding_window) == \
        (2880, 64, 64, 8, 201088, 128)
    assert args.schedule[:2] == ["sliding_attention", "full_attention"] and not args.tie_word_embeddings


def test_the_memory_plan_of_the_sink_attention_is_within_ten_percent_of_the_measured_peak():
    """debugmodel_gpt_oss, 2 x 256 tokens, no AC: the probabilities [heads, seq, seq + 1] each layer keeps dominate."""
    from benchmarks.memory_plan import SHAPES, job_of
    from benchmarks.training_run import estimate_bytes, measure

    job = job_of("full", SHAPES["debugmodel_gpt_oss"])
    estimate, result = estimate_bytes(job), measure(job, timeout=300)
    assert "error" not in result, result
    print(f"estimate {estimate:,} bytes, measured peak {result['peak_bytes']:,}")
    assert abs(estimate / result["peak_bytes"] - 1) <= 0.10, (estimate, result["peak_bytes"])


def test_the_20b_lora_recipe_plans_with_dry_run(capsys, monkeypatch):
    """train_configs/gpt_oss_20b_lora.toml on one 80 GB GPU before any download (the bundled tokenizer stands in):
    the plan fits; only the data and the weights are missing (exit 5)."""
    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", "1")
    cfg = parse_args(["--job.config_file", "train_configs/gpt_oss_20b_lora.toml", "--model.hf_assets_path",
                      "./assets/tokenizer"])
    assert dry_run(cfg) == 5
    out = capsys.readouterr().out
    # 20,914,757,184 of the model and 184,909,824 of adapters (rank 16 on q/k/v/o and on 48 expert groups)
    assert "model: llama3 gpt_oss_20b, 21,099,667,008 parameters, 24 layers; transforms: lora" in out
    assert "dry run OK" in out
    peak = float(re.search(r"largest peak ([\d.]+) GiB", out)[1])
    print(f"gpt_oss_20b_lora: largest peak {peak} GiB of 80")
    assert 40 < peak < 80


@pytest.mark.parametrize("recipe, flavor, params, capacity", [
    ("gpt_oss_20b_lora_24gb", "gpt_oss_20b", "21,099,667,008", 24.0),
    ("gpt_oss_120b_lora_80gb", "gpt_oss_120b", "117,365,970,240", 80.0)])
def test_the_mxfp4_base_recipes_plan_on_one_gpu(recipe, flavor, params, capacity, capsys, monkeypatch):
    """lora.base_dtype = "mxfp4": the experts counted at 0.53125 bytes a weight (the parameter count still the
    weights'), one expert's dequantized weight among the buffers; 20B fits one 24 GB GPU, 120B one 80 GB GPU."""
    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", "1")
    cfg = parse_args(["--job.config_file", f"train_configs/{recipe}.toml", "--model.hf_assets_path",
                      "./assets/tokenizer"])
    assert dry_run(cfg) == 5
    out = capsys.readouterr().out
    assert f"model: llama3 {flavor}, {params} parameters" in out
    experts = re.search(r"lora: MXFP4 base: the experts of \d+ MoE layers, ([\d,]+) weights in ([\d.]+) GiB", out)
    weights = int(experts[1].replace(",", ""))
    assert float(experts[2]) == round(weights * 0.53125 / 2**30, 2)
    assert "MXFP4 dequantization of one expert's weight (8,294,400 elements)" in out  # 2,880 x 2,880
    peak = float(re.search(r"largest peak ([\d.]+) GiB", out)[1])
    print(f"{recipe}: largest peak {peak} GiB of {capacity:g}")
    assert "dry run OK" in out and f"of {capacity:.2f} GiB" in out and peak < capacity
