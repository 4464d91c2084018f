"""Qwen3.5 (tiny_qwen3_5: three Gated DeltaNet layers before one gated attention, chunks of 16 steps) through
run_train.sh under every layout it runs: FSDP with compile, HSDP with full activation checkpointing, FSDP x TP (the
DeltaNet split by key-head groups) with selective AC, each one's per-step losses equal one process's on the same
global batch of 8 sequences of 64 tokens; TP, PP and CP on packed documents equal one process on the same rows; CP 2
(head-tail and contiguous, and beside FSDP 2) equals one process, and beside compile is refused in one line.
tests/test_qwen3_5_parallel.py checks TP's placements and gradients (and with compile) tensor by tensor."""

import pytest

from tests.integration.harness import assert_losses_close, one_window_dataset, run_train

SEQ_LEN = 64
GLOBAL_BATCH = 8
STEPS = 4
ATOL = 1e-5
FLAVOR = ["--model.flavor", "tiny_qwen3_5"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return [*one_window_dataset(tmp_path_factory.mktemp("data"), GLOBAL_BATCH * (STEPS + 1), SEQ_LEN),
            "--training.steps", str(STEPS), *FLAVOR]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[int, float]:
    run = run_train([*data, "--training.local_batch_size", str(GLOBAL_BATCH)], tmp_path_factory.mktemp("reference"))
    losses = run.tb_losses()
    assert run.returncode == 0 and sorted(losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert all(5.0 < v < 9.0 for v in losses.values()), losses
    return losses


SELECTIVE_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
# (id, processes, local batch, overrides, the layout the start-up line must name)
CASES = [
    ("fsdp2_compile", 2, 4, ["--compile.enable"], "dp_replicate 1 x dp_shard 2 x cp 1 x tp 1"),
    ("hsdp_replicate2_full_ac", 2, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                                       "--activation_checkpoint.mode", "full"],
     "dp_replicate 2 x dp_shard 1 x cp 1 x tp 1"),
    ("fsdp2_tp2_selective_op_ac", 4, 4, [*TP2, *SELECTIVE_OP], "dp_replicate 1 x dp_shard 2 x cp 1 x tp 2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, ngpu, local_batch, overrides, layout", CASES, ids=[c[0] for c in CASES])
def test_layout_matches_one_process(name, ngpu, local_batch, overrides, layout, data, reference, tmp_path):
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"} if "--compile.enable" in overrides else None
    run = run_train([*data, "--training.local_batch_size", str(local_batch), *overrides], tmp_path, ngpu=ngpu,
                    env=env)
    assert layout in run.output, run.output[-3000:]
    assert_losses_close(run, reference, ATOL)


# Packed documents (block-causal) of the bundled corpus: TP and PP read the same rows as one process (no data
# parallel split), each document from a zero DeltaNet state and conv window on every rank.
PACKED = ["--training.steps", str(STEPS), *FLAVOR, "--model.attn_mask_type", "block_causal",
          "--training.local_batch_size", str(GLOBAL_BATCH)]


@pytest.fixture(scope="module")
def packed_reference(tmp_path_factory) -> dict[int, float]:
    run = run_train(PACKED, tmp_path_factory.mktemp("packed_reference"))
    assert run.returncode == 0, run.output[-3000:]
    return run.tb_losses()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [TP2, ["--parallelism.pipeline_parallel_degree", "2",
                                             "--parallelism.pipeline_parallel_microbatch_size", "4"]],
                         ids=["tp2", "pp2"])
def test_packed_documents_match_one_process(overrides, packed_reference, tmp_path):
    assert_losses_close(run_train([*PACKED, *overrides], tmp_path, ngpu=2), packed_reference, ATOL)


CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


# Context parallel: each Gated DeltaNet chunk starts from the conv window and state of the chunks before it in time
# (all-gathered and composed: the rule is affine in its state), so CP equals one process, in both layouts.
@pytest.mark.slow
@pytest.mark.parametrize("balancer, fsdp", [("headtail", 1), ("none", 1), ("headtail", 2)],
                         ids=["headtail", "contiguous", "headtail_fsdp2"])
def test_context_parallel_matches_one_process(balancer, fsdp, data, reference, tmp_path):
    run = run_train([*data, "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                     str(fsdp), "--parallelism.context_parallel_load_balancer", balancer,
                     "--training.local_batch_size", str(GLOBAL_BATCH // fsdp)], tmp_path, ngpu=2 * fsdp)
    assert f"dp_shard {fsdp} x cp 2" in run.output, run.output[-3000:]
    assert_losses_close(run, reference, ATOL)


@pytest.mark.slow
def test_context_parallel_on_packed_documents_matches_one_process(packed_reference, tmp_path):
    assert_losses_close(run_train([*PACKED, *CP2], tmp_path, ngpu=2), packed_reference, ATOL)


def test_context_parallel_beside_compile_is_refused_in_one_line(data, tmp_path):
    run = run_train([*data, *CP2, "--compile.enable"], tmp_path, ngpu=2)
    assert run.returncode != 0
    assert ("parallelism.context_parallel_degree > 1 with compile.enable is not supported yet for Qwen3.5's "
            "linear_attention layers") in run.output
    assert "Traceback" not in run.output, run.output[-3000:]
