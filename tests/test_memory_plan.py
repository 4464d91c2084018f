"""DRY_RUN's memory plan against the measured peak of live tensors of real steps (benchmarks/memory_plan.py on the
tiny shape), and the rule that gradients and saved activations are not at their peaks together."""

import pytest

from benchmarks.memory_plan import SHAPES, job_of
from benchmarks.training_run import estimate_bytes, measure
from titan_lite.parallel import memory_estimate as me


def test_gradients_and_activations_are_counted_once_where_they_trade_places():
    activations = me.ActivationPeak(saved=1000, working=300, block_working=100)
    # backward starts with 1300 of activations and ends with 400 of gradients + 100: the peak is 1300, not 1700
    assert me.gradients_apart_from_activations(400, activations) == 400
    # gradients larger than the activations: the end of backward is the peak (2000 + 100)
    assert me.gradients_apart_from_activations(2000, activations) == 2000 + 1300 - 2100
    estimate = me.MemoryEstimate(10, 400, 800, 1300, 0, not_together=400)
    assert estimate.total == 10 + 800 + 1300 and any("overlap" in line for line in estimate.lines())


@pytest.mark.parametrize("case", ["full", "ac_full"])
def test_estimate_is_within_ten_percent_of_the_measured_peak(case):
    job = job_of(case, SHAPES["tiny"])
    estimate, result = estimate_bytes(job), measure(job, timeout=300)
    assert "error" not in result, result
    assert abs(estimate / result["peak_bytes"] - 1) <= 0.10, (estimate, result["peak_bytes"])


@pytest.mark.slow
def test_moe_lora_on_experts_under_fsdp_is_within_ten_percent_of_the_measured_peak():
    """The CPU twin of train_configs/qwen3_30b_a3b_lora.toml's layout: debugmodel_moe (every layer MoE), LoRA on
    attention and every expert, FSDP over 2 ranks, full AC."""
    job = job_of("lora_experts_fsdp2", SHAPES["debugmodel_moe"])
    estimate, result = estimate_bytes(job), measure(job, timeout=600)
    assert "error" not in result, result
    assert abs(estimate / result["peak_bytes"] - 1) <= 0.10, (estimate, result["peak_bytes"])
