"""DRY_RUN of Llama 3.1 8B with float8 switched on as torchtitan's docs recommend (train_configs/llama3_8b_float8.toml
against llama3_8b.toml): the float8 all-gather halves the gathered block weights, the float8 casts of the largest
linear's backward are planned, and the rest of the plan is unchanged."""

import re

from tests.test_dry_run import GIB, LLAMA_8B_PARAMS, assert_plans_fast_and_small, c4_shard, dry_run  # noqa: F401

BLOCK_PARAMS = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # one 8B block's linears (all float8)
W1_BACKWARD_CASTS = 8192 * (14336 + 4096) + 14336 * 4096  # output gradient + input + weight of w1, 1 byte each


def gib(run, row: str) -> float:
    return float(re.search(rf"  {row}\s+([\d.]+) GiB", run.stdout)[1])


def test_llama3_8b_float8_plans_on_8_ranks(c4_shard):  # noqa: F811
    plain = dry_run("llama3_8b.toml", c4_shard, ngpu=8, extra=("--compile.enable",))  # compiled like float8's
    float8 = dry_run("llama3_8b_float8.toml", c4_shard, ngpu=8)
    assert float8.returncode == plain.returncode == 0, float8.stdout + float8.stderr
    assert f"{LLAMA_8B_PARAMS:,} parameters, 32 layers; transforms: quantize.linear.float8" in float8.stdout
    assert ("quantize.linear.float8: 224 linear(s) in float8 (tensorwise, float8 all-gather with scale precompute)"
            in float8.stdout)
    assert "quantize.linear.float8: 1 linear(s) left in high precision: output (filter_fqns)" in float8.stdout
    assert "emulated" not in float8.stdout  # the plan is for the GPUs, not for this CPU
    # Two blocks' all-gathers in flight: the one counted in float8 saves 1 byte per weight against bf16.
    assert abs(gib(plain, "buffers") - gib(float8, "buffers") - BLOCK_PARAMS / GIB) < 0.01
    assert f"float8 casts in one linear's backward (layers.0.feed_forward.w1: output gradient, weight, input) " \
           f"{W1_BACKWARD_CASTS / 2**20:.0f} MiB" in float8.stdout
    assert abs(gib(float8, "activations") - gib(plain, "activations") - W1_BACKWARD_CASTS / GIB) < 0.01
    for row in ("parameters", "gradients", "optimizer"):
        assert gib(float8, row) == gib(plain, row)  # float8 weights stay high precision in memory
    assert_plans_fast_and_small(float8)
