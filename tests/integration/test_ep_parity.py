"""Expert parallelism through run_train.sh: a Qwen3-MoE (tiny_moe: 8 experts, top 2, 3 MoE layers and a dense one)
under each EP layout equals one process over 5 steps: the losses, the aux loss and every MoE layer's expert load
within 1e-5, the gradient norm within 1e-4 of itself (FSDP alone moves it by 1e-5: sums in another order); and a run
saved under EP resumes, under EP and on one process (DCP reshards the experts), within the same tolerance.

One launch per layout, the global batch of 8 sequences split as the layout splits data; the corpus has documents of
exactly seq_len + 1 tokens, so every split reads the same sequences (see test_parallel_parity.py). The aux-loss weight
is 0.1 so that a wrong share of its gradient would move the losses.
"""

import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration import test_moe_parity as moe_layouts
from tests.integration.harness import CKPT, run_train
from tests.integration.test_moe_parity import ATOL, STEPS, scalars

pytestmark = pytest.mark.slow

data = moe_layouts.data  # a fixture: the MoE layouts' corpus of one-window documents, model and aux-loss weight

GRAD_NORM_RTOL = 1e-4
EP2 = ["--parallelism.expert_parallel_degree", "2"]


def grad_norms(folder) -> dict[int, float]:
    acc = EventAccumulator(str(folder / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("grad_norm")}


def assert_equal_series(folder, reference_folder, steps=range(1, STEPS + 1), grad_norm_rtol=GRAD_NORM_RTOL) -> None:
    """The losses, aux loss and loads of the run in `folder` against the reference run's (1e-5); its grad norms."""
    got, reference = scalars(folder), scalars(reference_folder)
    assert sorted(got) == sorted(reference)
    for series, values in reference.items():
        for step in steps:
            assert abs(got[series][step] - values[step]) <= ATOL, \
                f"{series} step {step}: {got[series][step]} vs {values[step]}"
    norms, reference_norms = grad_norms(folder), grad_norms(reference_folder)
    for step in steps:
        assert abs(norms[step] - reference_norms[step]) <= grad_norm_rtol * reference_norms[step], (norms, step)


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """The folder of the reference run: one process, 8 sequences per step."""
    folder = tmp_path_factory.mktemp("one_process")
    run = run_train([*data, "--training.local_batch_size", "8"], folder, ngpu=1)
    assert run.returncode == 0 and "moe/aux_loss" in scalars(folder), run.output[-3000:]
    return folder


# (id, processes, local batch, overrides, the start-up line's layout): a global batch of 8 each.
LAYOUTS = [
    ("ep2", 2, 4, EP2, "dp_shard 2 x cp 1 x tp 1 x pp 1 (experts: ep 2 x efsdp 1)"),
    # the experts FSDP-sharded over the 2 ranks of each EP group's position; full AC recomputes the all-to-alls
    ("ep2_fsdp4_ac_full", 4, 2, [*EP2, "--activation_checkpoint.mode", "full"],
     "dp_shard 4 x cp 1 x tp 1 x pp 1 (experts: ep 2 x efsdp 2)"),
    # EP borrows the TP ranks: each routes the gathered sequence and sends its share of the rows
    ("tp2_ep2", 2, 8, [*EP2, "--parallelism.tensor_parallel_degree", "2"],
     "dp_shard 1 x cp 1 x tp 2 x pp 1 (experts: ep 2 x efsdp 1)"),
    ("pp2_tp2_ep2", 4, 8, [*EP2, "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree",
                           "2", "--parallelism.pipeline_parallel_microbatch_size", "4"],
     "dp_shard 1 x cp 1 x tp 2 x pp 2 (experts: ep 2 x efsdp 1)"),
    ("cp2_ep2", 2, 8, [*EP2, "--parallelism.context_parallel_degree", "2"],
     "dp_shard 1 x cp 2 x tp 1 x pp 1 (experts: ep 2 x efsdp 1)"),
]


@pytest.mark.parametrize("name, ngpu, local_batch, overrides, layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_ep_layout_equals_one_process(name, ngpu, local_batch, overrides, layout, data, one_process,
                                      tmp_path_factory):
    folder = tmp_path_factory.mktemp(name)
    run = run_train([*data, "--training.local_batch_size", str(local_batch), *overrides], folder, ngpu=ngpu)
    assert run.returncode == 0, run.output[-3000:]
    assert layout in run.output, run.output[-3000:]
    assert_equal_series(folder, one_process)


def test_a_run_saved_under_ep_resumes_under_ep_and_on_one_process(data, one_process, tmp_path):
    """3 steps under EP 2 with checkpoints, then steps 4-5 resumed by EP 2 and by one process (the experts, saved
    as DTensors sharded over ep, read back whole)."""
    # the 5-step LR schedule of the reference, stopped after step 3
    first = run_train([*data, "--training.steps", "3", "--lr_scheduler.total_steps", str(STEPS), "--training"
                       ".local_batch_size", "4", *EP2, *CKPT, "--checkpoint.interval", "3"], tmp_path / "ep", ngpu=2)
    assert first.returncode == 0, first.output[-3000:]
    shutil.copytree(tmp_path / "ep" / "checkpoint", tmp_path / "one" / "checkpoint")
    resumed = {"ep": run_train([*data, "--training.local_batch_size", "4", *EP2, *CKPT], tmp_path / "ep", ngpu=2),
               "one": run_train([*data, "--training.local_batch_size", "8", *CKPT], tmp_path / "one", ngpu=1)}
    for name, run in resumed.items():
        assert run.returncode == 0, run.output[-3000:]
        assert f"loaded checkpoint {tmp_path / name / 'checkpoint' / 'step-3'}" in run.output, run.output[-3000:]
        assert_equal_series(tmp_path / name, one_process, steps=(4, 5))


def test_lora_on_experts_under_ep_equals_one_process(data, tmp_path):
    """Grouped expert adapters ([E, r, in], [E, out, r]) are split over the EP ranks with their experts."""
    lora = ["--model.converters", "lora", "--lora.target_modules", "wq,experts", "--lora.rank", "4"]
    for name, ngpu, local_batch, overrides in (("one", 1, 8, []), ("ep2", 2, 4, EP2)):
        run = run_train([*data, *lora, "--training.local_batch_size", str(local_batch), *overrides], tmp_path / name,
                        ngpu=ngpu)
        assert run.returncode == 0, run.output[-3000:]
    assert_equal_series(tmp_path / "ep2", tmp_path / "one")
