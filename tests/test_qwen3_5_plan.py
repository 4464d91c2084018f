"""Qwen3.5 before the GPUs are rented: the dense flavors' parameter counts, DRY_RUN's memory plan of the Gated DeltaNet
layers (against the tensors autograd saves, and the measured peak of real CPU steps), the recurrent states a
generation holds, the 24 GB recipes planned, and the delta rule's FLOPs in MFU."""

import re
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from titan_lite.generate import kv_cache_bytes
from titan_lite.metrics.flops import delta_rule_flops_per_token
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.parts.block import TransformerBlock
from titan_lite.models.parts.gated_deltanet import chunked_delta_rule
from titan_lite.models.parts.rope import rope_cache
from titan_lite.parallel import memory_estimate as me


@pytest.mark.parametrize("flavor, total", [("qwen3_5_27B", 26.90), ("qwen3_5_9B", 8.95)])
def test_the_dense_flavors_have_the_counted_parameters(flavor, total):
    """families_2026.md section 5: 26.90B (Qwen3.5-27B, text) and 8.95B (the 9B-style class defaults)."""
    args = flavor_args(flavor)
    with torch.device("meta"):
        params = Llama(args).num_params()
    assert round(params / 1e9, 2) == total
    assert args.schedule[:4] == ["linear_attention"] * 3 + ["full_attention"] and not args.tie_word_embeddings


def _saved_bytes(block: torch.nn.Module, x: torch.Tensor, rope: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one block's forward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", [0, 3])  # a Gated DeltaNet block, a gated attention block
def test_a_block_s_planned_activations_are_what_autograd_saves(dtype, layer):
    """tiny_qwen3_5 widened so no two widths agree (3 key heads of 16, 6 value heads of 24), one row of 96 tokens
    (six chunks of 16): the plan of one block without AC against the storages its forward saves."""
    args = replace(flavor_args("tiny_qwen3_5"), linear_n_key_heads=3, linear_n_value_heads=6, linear_key_head_dim=16,
                   linear_value_head_dim=24)
    torch.manual_seed(0)
    block = TransformerBlock(args, layer).to(dtype)
    x = torch.randn(1, 96, args.dim, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(block, x, rope_cache(replace(args, max_seq_len=96)))
    shape = me.ActivationShape(tokens=96, compute_bytes=dtype.itemsize, seq_len=96)
    planned = me.layer_activation_bytes(args, layer, shape, me.NO_AC)
    print(f"layer {layer} {dtype}: planned {planned:,} bytes, saved {measured:,}")
    assert abs(planned / measured - 1) <= 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_moe_block_s_plan_counts_the_gated_shared_expert(dtype):
    """debugmodel_qwen3_5_moe's gated attention block (routed, with a shared expert widened to 320 so that no two
    widths agree), one row of 96 tokens: the plan without AC against the storages its forward saves."""
    args = replace(flavor_args("debugmodel_qwen3_5_moe"), moe_shared_ffn_dim=320)
    torch.manual_seed(0)
    block = TransformerBlock(args, 3).to(dtype)
    x = torch.randn(1, 96, args.dim, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(block, x, rope_cache(replace(args, max_seq_len=96)))
    shape = me.ActivationShape(tokens=96, compute_bytes=dtype.itemsize, seq_len=96)
    planned = me.layer_activation_bytes(args, 3, shape, me.NO_AC)
    print(f"{dtype}: planned {planned:,} bytes, saved {measured:,}")
    assert me.gated_shared_expert_bytes(args, shape) > 0.1 * measured
    assert abs(planned / measured - 1) <= 0.01


@pytest.mark.parametrize("case", ["full", "ac_full"])
def test_the_plan_is_within_ten_percent_of_the_measured_peak(case):
    """tiny_qwen3_5 (three Gated DeltaNet layers, one gated attention), 2 x 64 tokens, AC none and full."""
    from benchmarks.memory_plan import SHAPES, job_of
    from benchmarks.training_run import estimate_bytes, measure

    job = job_of(case, SHAPES["tiny_qwen3_5"])
    estimate, result = estimate_bytes(job), measure(job, timeout=300)
    assert "error" not in result, result
    print(f"{case}: estimate {estimate:,} bytes, measured peak {result['peak_bytes']:,}")
    assert abs(estimate / result["peak_bytes"] - 1) <= 0.10, (estimate, result["peak_bytes"])


@pytest.mark.slow
def test_the_debug_model_s_plan_is_within_ten_percent_of_the_measured_peak():
    """debugmodel_qwen3_5 (8 layers, chunks of 64), 2 x 256 tokens, no AC."""
    from benchmarks.memory_plan import SHAPES, job_of
    from benchmarks.training_run import estimate_bytes, measure

    job = job_of("full", SHAPES["debugmodel_qwen3_5"])
    estimate, result = estimate_bytes(job), measure(job, timeout=300)
    assert "error" not in result, result
    assert abs(estimate / result["peak_bytes"] - 1) <= 0.10, (estimate, result["peak_bytes"])


def test_the_generation_cache_holds_each_layer_type_s_state():
    """Per completion: the attention layers' K/V per slot (kv heads split over TP), each DeltaNet layer's last K - 1
    conv columns on every channel (replicated) and its float32 state of this rank's value heads."""
    args = flavor_args("qwen3_5_27B")
    slots, c = 1000, 2
    attention = 16 * 2 * 4 * 256 * c  # 16 layers, K and V of 4 kv heads of 256
    conv, state = (2 * 16 * 128 + 48 * 128) * 3 * c, 48 * 128 * 128 * 4
    bookkeeping = slots + 9  # mask row, real, positions
    assert kv_cache_bytes(args, 1, slots, c) == slots * (attention + bookkeeping) + 48 * (conv + state)
    assert kv_cache_bytes(args, 1, slots, c, tp=2) == slots * (attention // 2 + bookkeeping) + 48 * (conv + state // 2)


@pytest.mark.parametrize("recipe, flavor", [("qwen3_5_27b_qlora", "qwen3_5_27B"),
                                            ("qwen3_5_27b_grpo_gsm8k", "qwen3_5_27B")])
def test_the_24_gb_recipes_plan_with_dry_run(capsys, monkeypatch, recipe, flavor):
    """train_configs' Qwen3.5 recipes on one 24 GB GPU before any download (the bundled tokenizer stands in): the
    plan fits, the GRPO rollout too; only the data and the weights are missing (exit 5)."""
    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", "1")
    cfg = parse_args(["--job.config_file", f"train_configs/{recipe}.toml", "--model.hf_assets_path",
                      "./assets/tokenizer", "--dry_run.device_memory_gib", "24"])
    assert dry_run(cfg) == 5
    out = capsys.readouterr().out
    assert f"model: llama3 {flavor}, " in out and "dry run OK: 1 rank" in out
    peaks = [float(p) for p in re.findall(r"  peak +([\d.]+) GiB", out)]
    print(f"{recipe}: peaks {peaks} GiB of 24")
    assert peaks and all(10 < p < 24 for p in peaks)


def test_the_delta_rule_s_flops_are_counted_by_hand():
    """The batched matmuls of one chunked forward as torch's FLOP counter counts them, plus the two unit-triangular
    solves (C^2 per right-hand column per chunk, which the counter does not count), x 3 for training, per token."""
    args = replace(flavor_args("tiny_qwen3_5"), linear_chunk_size=16)
    heads, dk, dv, chunk = args.linear_n_value_heads, args.linear_key_head_dim, args.linear_value_head_dim, 16
    tokens = 4 * chunk
    q, k = torch.randn(1, tokens, args.linear_n_key_heads, dk), torch.randn(1, tokens, args.linear_n_key_heads, dk)
    v, g, beta = torch.randn(1, tokens, heads, dv), -torch.rand(1, tokens, heads), torch.rand(1, tokens, heads)
    with FlopCounterMode(display=False) as counter:
        chunked_delta_rule(q, k, v, g, beta, chunk=chunk)
    solves = heads * (tokens // chunk) * chunk * chunk * (dk + dv)
    per_layer = 3 * (counter.get_total_flops() + solves) // tokens
    assert delta_rule_flops_per_token(args) == 3 * per_layer  # tiny_qwen3_5's three DeltaNet layers
    # Qwen3.5-27B: 48 layers x 48 value heads x (5 x 64 x 128 + 3 x 64 x 128 + 6 x 128 x 128) x 3
    assert delta_rule_flops_per_token(flavor_args("qwen3_5_27B")) == 48 * 48 * 163840 * 3
