"""Distillation runs as users start them (run_train.sh, [distill] overrides): the losses of FSDP 2, TP 2 (vocab-
sharded logits) and CP 2 equal one process's, the logged KL and CE parts make up the loss, and the self-teacher (LoRA
with teacher_path = "base") trains exactly as with an explicit copy of the base as the teacher.

Every run sees the same global batch of 8 sequences per step (one-window documents, as in test_parallel_parity.py);
the teacher is the tiny flavor perturbed away from the student's initialisation.
"""

import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import (
    REPO,
    Run,
    assert_losses_close,
    one_window_dataset,
    perturbed_hf_folder,
    run_train,
)
from tests.warm_python import python_command

SEQ_LEN, GLOBAL_BATCH, STEPS = 64, 8, 3
DISTILL = ["--distill.enable", "--distill.alpha", "0.5", "--distill.temperature", "2", "--training.steps", str(STEPS)]


def scalars(run: Run, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(run.dump_folder / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    """The data and the teacher folder of every run."""
    folder = tmp_path_factory.mktemp("distill")
    teacher = perturbed_hf_folder(folder / "teacher", "tiny")
    data = one_window_dataset(folder, GLOBAL_BATCH * STEPS + GLOBAL_BATCH, SEQ_LEN)
    return [*data, *DISTILL, "--distill.teacher_path", str(teacher)]


@pytest.fixture(scope="module")
def reference(common, tmp_path_factory) -> Run:
    run = run_train([*common, "--training.local_batch_size", "8"], tmp_path_factory.mktemp("reference"))
    assert run.returncode == 0, run.output[-3000:]
    assert "distill: teacher tiny from" in run.output and "459,328 parameters" in run.output
    return run


def test_the_logged_parts_make_up_the_loss(reference):
    """loss = alpha T^2 KL + (1 - alpha) CE, from the KL and CE logged beside it (TensorBoard's float32 values)."""
    losses, kl, ce = reference.tb_losses(), scalars(reference, "distill/kl"), scalars(reference, "distill/ce")
    assert sorted(losses) == sorted(kl) == sorted(ce) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - (0.5 * 4 * kl[step] + 0.5 * ce[step])) < 1e-5, (step, loss, kl[step], ce[step])
    assert all(0 < v < 5 for v in kl.values()) and all(5 < v < 9 for v in ce.values()), (kl, ce)


# (id, processes, local batch, overrides, what the start-up line says)
LAYOUTS = [
    ("fsdp2", 2, 4, [], "dp_replicate 1 x dp_shard 2 x cp 1 x tp 1"),
    ("tp2", 2, 8, ["--parallelism.tensor_parallel_degree", "2"], "dp_replicate 1 x dp_shard 1 x cp 1 x tp 2"),
    ("cp2", 2, 8, ["--parallelism.context_parallel_degree", "2"], "dp_replicate 1 x dp_shard 1 x cp 2 x tp 1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, ngpu, local_batch, overrides, layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_distilled_losses_match_one_process(name, ngpu, local_batch, overrides, layout, common, reference, tmp_path):
    """The teacher is sharded by the student's mesh; under TP both logits are vocab-sharded (loss parallel)."""
    run = run_train([*common, "--training.local_batch_size", str(local_batch), *overrides], tmp_path, ngpu=ngpu)
    assert layout in run.output, run.output[-3000:]
    assert_losses_close(run, reference.tb_losses(), 1e-5)
    expected_kl, kl = scalars(reference, "distill/kl"), scalars(run, "distill/kl")
    assert all(abs(kl[step] - expected_kl[step]) < 1e-5 for step in expected_kl), (kl, expected_kl)


@pytest.mark.slow
def test_the_self_teacher_equals_an_explicit_copy_of_the_base(common, tmp_path):
    """LoRA on a base loaded from an HF folder: teacher_path = "base" (the same model, adapters off, no second copy)
    and teacher_path = that folder give the same losses; at step 1 the student is its base (B = 0): KL 0."""
    base = Path(common[common.index("--distill.teacher_path") + 1])
    lora = [*common, "--training.local_batch_size", "8", "--model.converters", "lora",
            "--checkpoint.initial_load_path", str(base), "--checkpoint.initial_load_in_hf"]
    own = run_train([*lora, "--distill.teacher_path", "base"], tmp_path / "own")
    copy = run_train(lora, tmp_path / "copy")
    assert own.returncode == 0, own.output[-3000:]
    assert "the teacher is the student's own base, its adapters switched off" in own.output
    assert "distill: teacher tiny from" in copy.output
    assert_losses_close(copy, own.tb_losses(), 1e-6)
    assert scalars(own, "distill/kl")[1] == 0.0 and scalars(copy, "distill/kl")[1] == 0.0
    assert scalars(own, "distill/kl")[STEPS] > 0  # the adapters moved the student away from its base


def test_a_dcp_teacher_with_its_runs_config_equals_the_hf_teacher(common, reference, tmp_path):
    """The teacher as a DCP step folder (scripts/convert_checkpoint.py hf-to-dcp) whose shape comes from the run's
    config.toml two folders up: the same losses as the HF folder it came from."""
    hf = common[common.index("--distill.teacher_path") + 1]
    step = tmp_path / "teacher_run" / "checkpoint" / "step-7"
    convert = subprocess.run([*python_command(), str(REPO / "scripts" / "convert_checkpoint.py"), "hf-to-dcp", hf,
                              str(step)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert convert.returncode == 0, convert.stderr[-2000:]
    (tmp_path / "teacher_run" / "config.toml").write_text('[model]\nflavor = "tiny"\n'
                                                          'hf_assets_path = "./assets/tokenizer"\n')
    run = run_train([*common, "--training.local_batch_size", "8", "--distill.teacher_path", str(step)],
                    tmp_path / "run")
    assert f"distill: teacher tiny from '{step}'" in run.output, run.output[-3000:]
    assert_losses_close(run, reference.tb_losses(), 1e-6)
