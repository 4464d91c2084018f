"""Context parallel through run_train.sh: per-step losses equal a single-process run on the same global batch."""

import pytest

from tests.integration.harness import assert_losses_close, run_train

# The global batch is local_batch_size x dp degree; pinning it keeps every layout on the same data.
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> dict[int, float]:
    run = run_train(["--training.local_batch_size", str(GLOBAL_BATCH)], tmp_path_factory.mktemp("single"), ngpu=1)
    assert run.returncode == 0, run.output[-3000:]
    losses = run.tb_losses()
    assert sorted(losses) == [1, 2, 3, 4, 5] and all(2.0 < v < 10.0 for v in losses.values()), losses
    return losses


@pytest.mark.parametrize("load_balancer", ["headtail", "none"])
def test_cp2_matches_single_process(reference_losses, tmp_path, load_balancer):
    run = run_train(["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                     "--parallelism.context_parallel_load_balancer", load_balancer,
                     "--training.local_batch_size", str(GLOBAL_BATCH)], tmp_path, ngpu=2)
    assert_losses_close(run, reference_losses, atol=1e-5)


def test_fsdp2_cp2_matches_single_process(reference_losses, tmp_path):
    run = run_train(["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                     "--training.local_batch_size", str(GLOBAL_BATCH // 2)], tmp_path, ngpu=4)
    assert_losses_close(run, reference_losses, atol=1e-5)


def test_indivisible_seq_len_is_one_clear_line(tmp_path):
    run = run_train(["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"], tmp_path, ngpu=2)
    assert run.returncode != 0
    assert "'training.seq_len' = 66 must be divisible by 4 (2 x context_parallel_degree 2)" in run.output
    assert "Traceback" not in run.output
