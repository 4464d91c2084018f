"""Qwen3.5-MoE (debugmodel_qwen3_5_moe: 3 Gated DeltaNet layers and a gated attention, every layer routed beside its
gated shared expert) through run_train.sh: expert parallelism 2 with the rest FSDP-sharded over the same 2 gloo
ranks, and full activation checkpointing recomputing the all-to-alls, equals one process over 5 steps: the losses,
the aux loss and every layer's expert load within 1e-5, the gradient norm within 1e-4 of itself.

The corpus has documents of exactly seq_len + 1 tokens, so both splits of the global batch of 8 read the same
sequences; the aux-loss weight is 0.1 so that a wrong share of its gradient would move the losses.
"""

import pytest

from tests.integration.harness import one_window_dataset, run_train
from tests.integration.test_ep_parity import EP2, assert_equal_series
from tests.integration.test_moe_parity import SEQ_LEN, STEPS, scalars

pytestmark = pytest.mark.slow

MODEL = ["--model.flavor", "debugmodel_qwen3_5_moe", "--model.router_aux_loss_coef", "0.1"]


def test_ep2_with_fsdp_and_ac_equals_one_process(tmp_path):
    data = [*one_window_dataset(tmp_path, 8 * (STEPS + 1), SEQ_LEN), "--training.steps", str(STEPS), *MODEL]
    one = run_train([*data, "--training.local_batch_size", "8"], tmp_path / "one", ngpu=1)
    assert one.returncode == 0, one.output[-3000:]
    assert {"moe/aux_loss", "moe/load_max_over_mean/layer_0", "moe/load_max_over_mean/layer_3"} <= set(
        scalars(tmp_path / "one"))
    ep = run_train([*data, "--training.local_batch_size", "4", *EP2, "--activation_checkpoint.mode", "full"],
                   tmp_path / "ep2", ngpu=2)
    assert ep.returncode == 0, ep.output[-3000:]
    assert "dp_shard 2 x cp 1 x tp 1 x pp 1 (experts: ep 2 x efsdp 1)" in ep.output, ep.output[-3000:]
    assert_equal_series(tmp_path / "ep2", tmp_path / "one")
