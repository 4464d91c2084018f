"""DeepSeek-V3 before the GPUs are rented: DRY_RUN's memory plan of latent attention, the group router and the
shared experts against the measured peak of a real CPU step, the rollout's expanded latent, the shipped 671B LoRA
recipe planned; and MFU's attention FLOPs for latent attention and sliding windows, against hand counts."""

import re

import pytest

from titan_lite.metrics.flops import attention_flops_per_token, model_flops_per_token, num_flops_per_token
from titan_lite.models.flavors import flavor_args


@pytest.mark.slow  # a training process per case
@pytest.mark.parametrize("case", ["full", "ac_full"])
def test_the_memory_plan_is_within_ten_percent_of_the_measured_peak(case):
    """debugmodel_deepseek_v3, 1 x 512 tokens, AC none and full: on a CPU the latent attention's unequal q/k and v
    widths take SDPA's math kernel, whose probabilities per head the plan counts."""
    from benchmarks.memory_plan import Shape, job_of
    from benchmarks.training_run import estimate_bytes, measure

    job = job_of(case, Shape("debugmodel_deepseek_v3", 512, 1))
    estimate, result = estimate_bytes(job), measure(job, timeout=300)
    assert "error" not in result, result
    print(f"{case}: estimate {estimate:,} bytes, measured peak {result['peak_bytes']:,}")
    assert abs(estimate / result["peak_bytes"] - 1) <= 0.10, (estimate, result["peak_bytes"])


def test_the_rollout_plan_counts_the_latent_cache_and_its_expansion():
    """Per latent layer the cache holds the normed latent and the rope key of each slot; a forward expands every
    slot into kv_b_proj's [k_nope | v] and the keys [k_nope | k_rope] of each head (TP: this rank's heads)."""
    from titan_lite.generate import kv_cache_bytes, latent_expansion_bytes

    args = flavor_args("deepseek_v3_671B")
    per_slot = 61 * (512 + 64) * 2  # bf16
    assert kv_cache_bytes(args, 4, 1024, 2) == 4 * 1024 * (per_slot + 1024 + 9)
    assert latent_expansion_bytes(args, 4, 1024, 2, tp=8) == 4 * 1024 * 16 * (128 + 128 + 128 + 64) * 2
    assert latent_expansion_bytes(flavor_args("8B"), 4, 1024, 2) == 0


def test_the_671b_lora_recipe_plans_on_three_nodes(capsys, monkeypatch):
    """train_configs/deepseek_v3_671b_lora.toml on 3 x 8 x 80 GB before any download (the bundled tokenizer stands
    in): EP 8 under FSDP over 24 ranks fits; only the data and the weights are missing (exit 5)."""
    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", "8")
    monkeypatch.setenv("NNODES", "3")
    cfg = parse_args(["--job.config_file", "train_configs/deepseek_v3_671b_lora.toml", "--model.hf_assets_path",
                      "./assets/tokenizer"])
    assert dry_run(cfg) == 5
    out = capsys.readouterr().out
    # 671,026,522,112 of the model (37.55B active) and 4,888,276,480 of adapters (rank 16 on o_proj and on 116
    # expert groups)
    assert "model: llama3 deepseek_v3_671B, 675,914,798,592 parameters, 61 layers; transforms: lora" in out
    assert "(experts: ep 8 x efsdp 3)" in out and "dry run OK: 24 ranks" in out
    peak = float(re.search(r"largest peak ([\d.]+) GiB", out)[1])
    print(f"deepseek_v3_671b_lora: largest peak {peak} GiB of 80")
    assert 60 < peak < 80


def test_latent_attention_flops_count_the_score_and_value_widths():
    """Per head and key: 2 x (qk_nope + qk_rope) for the scores, 2 x v_head_dim for the values, x 3 (forward and
    backward); DeepSeek-V3 at 4,096 tokens: 61 layers x 128 heads x (192 + 128) x 4096 x 6."""
    args = flavor_args("deepseek_v3_671B")
    assert args.attention_shapes()[0] == (128, 192, 128, None)
    assert attention_flops_per_token(args.attention_shapes(), 4096) == 61 * 128 * (192 + 128) * 4096 * 6
    # equal widths reduce to the established 12 L H hd T
    llama = flavor_args("8B")
    assert attention_flops_per_token(llama.attention_shapes(), 8192) == \
        num_flops_per_token(0, 0, 32, 32, 128, 8192)


def test_sliding_layers_count_only_their_window():
    """A window of 4 over 8 tokens: positions 1..8 attend to 1, 2, 3, 4, 4, 4, 4, 4 keys (26, mean 3.25); a window
    of 16 over 8 tokens: 1..8 (36, mean 4.5). gpt-oss's even layers slide (128), its odd ones attend to all."""
    assert attention_flops_per_token([(2, 8, 8, 4)], 8) == 6 * 2 * 16 * 26 / 8
    assert attention_flops_per_token([(2, 8, 8, 16)], 8) == 6 * 2 * 16 * 36 / 8
    assert attention_flops_per_token([(2, 8, 8, None)], 8) == 6 * 2 * 16 * 8
    args = flavor_args("gpt_oss_20b")
    window_keys = (128 * 129 / 2 + (2048 - 128) * 128) / 2048
    expected = 12 * 64 * 128 * 6 * (window_keys + 2048)
    assert attention_flops_per_token(args.attention_shapes(), 2048) == pytest.approx(expected, rel=1e-12)
    gemma = flavor_args("gemma3_12B")  # five sliding layers (1,024) to one full
    sliding = sum(window is not None for *_, window in gemma.attention_shapes())
    assert (sliding, len(gemma.attention_shapes())) == (40, 48)


def test_model_flops_add_the_dense_term_and_skip_linear_attention():
    """6 (N - embedding) - 2 x frozen, plus the attention of the softmax layers only (Qwen3.5's Gated DeltaNet
    layers' projections are in 6N)."""
    args = flavor_args("tiny_qwen3_5")
    assert args.attention_shapes() == [(4, 32, 32, None)]
    assert model_flops_per_token(1000, 200, args.attention_shapes(), 64, frozen_params=100) == \
        6 * 800 - 200 + 6 * 4 * 64 * 64
