"""Context parallel through run_train.sh: per-step losses equal a single process on the same global batch."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import assert_losses_close, one_window_dataset, run_train

# The global batch is local_batch_size x dp degree; pinning it (on one-sequence documents) keeps every layout on the
# same data, also with two data-parallel ranks.
GLOBAL_BATCH = 8
SEQ_LEN = 64
# Validation at twice the training length: CP must shard it too, and RoPE must find global positions at any length.
VALIDATION = ["--validation.enable", "--validation.freq", "5", "--validation.seq_len", "128", "--validation.steps", "2",
              "--validation.local_batch_size", "4"]


def validation_loss(run) -> float:
    acc = EventAccumulator(str(run.dump_folder / "tb"))
    acc.Reload()
    (event,) = acc.Scalars("validation/loss")
    return event.value


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return one_window_dataset(tmp_path_factory.mktemp("data"), GLOBAL_BATCH * 6, SEQ_LEN)


@pytest.fixture(scope="module")
def single_run(data, tmp_path_factory):
    run = run_train([*data, "--training.local_batch_size", str(GLOBAL_BATCH), *VALIDATION],
                    tmp_path_factory.mktemp("single"))
    assert run.returncode == 0, run.output[-3000:]
    return run


@pytest.fixture(scope="module")
def reference_losses(single_run) -> dict[int, float]:
    losses = single_run.tb_losses()
    assert sorted(losses) == [1, 2, 3, 4, 5] and all(2.0 < v < 10.0 for v in losses.values()), losses
    return losses


def test_cp2_tp2_matches_single_process(data, reference_losses, tmp_path):
    # Sequence parallel splits each CP rank's chunks again over TP; RoPE and the attention mask must still see
    # the CP-level global positions.
    run = run_train([*data, "--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", str(GLOBAL_BATCH)],
                    tmp_path, ngpu=4)
    assert_losses_close(run, reference_losses, atol=1e-5)


def test_cp2_matches_single_process(data, single_run, reference_losses, tmp_path):
    # Head-tail balancing (the default); the contiguous split is checked against full attention in
    # test_context_parallel.
    run = run_train([*data, "--parallelism.context_parallel_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1",
                     "--training.local_batch_size", str(GLOBAL_BATCH), *VALIDATION], tmp_path, ngpu=2)
    assert_losses_close(run, reference_losses, atol=1e-5)
    assert abs(validation_loss(run) - validation_loss(single_run)) <= 1e-5


def test_fsdp2_cp2_matches_single_process(data, reference_losses, tmp_path):
    run = run_train([*data, "--parallelism.context_parallel_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "2",
                     "--training.local_batch_size", str(GLOBAL_BATCH // 2)], tmp_path, ngpu=4)
    assert "dp_replicate 1 x dp_shard 2 x cp 2 x tp 1" in run.output, run.output[-3000:]
    assert_losses_close(run, reference_losses, atol=1e-5)


def test_indivisible_seq_len_is_one_clear_line(tmp_path):
    run = run_train(["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"], tmp_path, ngpu=2)
    assert run.returncode != 0
    assert "'training.seq_len' = 66 must be divisible by 4 (2 x context_parallel_degree 2)" in run.output
    assert "Traceback" not in run.output
