"""Pipeline parallel through run_train.sh: each schedule's per-step losses equal a single-process run on one batch."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import Run, assert_losses_close, run_train

LOCAL_BATCH = 8
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
# Validation at steps 2 and 4 on 3 short batches: under PP it runs through the stages with the schedule's eval().
VALIDATION = ["--validation.enable", "--validation.seq_len", "32", "--validation.local_batch_size", "4",
              "--validation.freq", "2", "--validation.steps", "3"]


def validation_losses(run: Run) -> dict[int, float]:
    acc = EventAccumulator(str(run.dump_folder / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("validation/loss")}


def checked_losses(run: Run, with_validation: bool) -> tuple[dict[int, float], dict[int, float]]:
    assert run.returncode == 0, run.output[-3000:]
    losses = run.tb_losses()
    assert sorted(losses) == [1, 2, 3, 4, 5] and all(2.0 < v < 10.0 for v in losses.values()), losses
    validation = validation_losses(run) if with_validation else {}
    assert not with_validation or sorted(validation) == [2, 4], validation
    return losses, validation


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, float], dict[int, float]]:
    """One process, the same 8 sequences per step, with validation."""
    run = run_train(["--training.local_batch_size", str(LOCAL_BATCH), *VALIDATION],
                    tmp_path_factory.mktemp("single"), ngpu=1)
    return checked_losses(run, with_validation=True)


@pytest.fixture(scope="module")
def reference_two_data_ranks(tmp_path_factory) -> dict[int, float]:
    """One process with the 16-sequence global batch of two data-parallel ranks (gradient accumulation 2 x 8),
    read through 2 loader workers: any layout with the same global batch sees the same samples."""
    run = run_train(["--training.local_batch_size", str(LOCAL_BATCH),
                     "--training.global_batch_size", str(2 * LOCAL_BATCH),
                     "--training.dataloader.num_workers", "2"], tmp_path_factory.mktemp("single16"), ngpu=1)
    return checked_losses(run, with_validation=False)[0]


def assert_matches_with_validation(run: Run, reference: tuple[dict[int, float], dict[int, float]]) -> None:
    assert_losses_close(run, reference[0], atol=1e-5)
    got = validation_losses(run)
    assert sorted(got) == sorted(reference[1]), got
    for step, value in reference[1].items():
        assert abs(got[step] - value) <= 1e-5, f"validation step {step}: {got[step]} vs {value}"


# GPipe runs with TP below and Interleaved1F1B with FSDP: every schedule is covered once.
@pytest.mark.parametrize("schedule", ["1F1B", "LoopedBFS", "InterleavedZeroBubble"])
def test_pp2_schedule_matches_single_process(reference, tmp_path, schedule):
    run = run_train([*PP2, "--parallelism.pipeline_parallel_schedule", schedule, *VALIDATION], tmp_path, ngpu=2)
    assert_matches_with_validation(run, reference)


def test_pp2_zbv_with_accumulation_matches_single_process(reference_two_data_ranks, tmp_path):
    # ZBV puts stages 0 and 3 on rank 0 (a V), so one rank feeds the inputs and computes the loss; two schedule
    # steps per optimizer step (gradient accumulation) must add up like one 16-sequence batch.
    run = run_train([*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
                     "--training.global_batch_size", str(2 * LOCAL_BATCH), "--training.dataloader.num_workers", "2"],
                    tmp_path, ngpu=2)
    assert_losses_close(run, reference_two_data_ranks, atol=1e-5)


def test_pp2_fsdp2_matches_single_process(reference_two_data_ranks, tmp_path):
    run = run_train([*PP2, "--parallelism.data_parallel_shard_degree", "2",
                     "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], tmp_path, ngpu=4)
    assert_losses_close(run, reference_two_data_ranks, atol=1e-5)


def test_pp2_tp2_gpipe_matches_single_process(reference, tmp_path):
    # Sequence-parallel activations cross the stage boundary; the last stage's loss runs on vocab-sharded logits.
    run = run_train([*PP2, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                     "1", "--parallelism.pipeline_parallel_schedule", "GPipe", *VALIDATION], tmp_path, ngpu=4)
    assert_matches_with_validation(run, reference)


def test_indivisible_layers_per_stage_is_one_clear_line(tmp_path):
    run = run_train([*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "4"], tmp_path, ngpu=2)
    assert run.returncode != 0
    assert ("'parallelism.pipeline_parallel_layers_per_stage' = 4 does not divide the layers: 4 layers + "
            "first_stage_less_layers 1 + last_stage_less_layers 1 = 6, and 6 % 4 = 2") in run.output
    assert "Traceback" not in run.output
