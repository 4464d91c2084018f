"""The transform contract end to end: a toy transform (tests/toy_transform.py) through run_train.sh on 1 process,
FSDP 2, TP 2 and PP 2: hook order, its parameters' init, its TP plan, after_load after the initial weights, its
param group, extra loss, state across a resume, metrics in TensorBoard, and its HF export."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import Run, assert_losses_close, one_window_dataset, run_train
from titan_lite.checkpoint.hf import weight_files

SEQ_LEN = 64
STEPS = 4
TOY = ["--model.converters", "toy_gate", "--experimental.custom_import", "tests.toy_transform"]
HOOK_LINE = re.compile(r"\[rank(\d)\]:.*toy hook: (\w+)(.*)")
# The order a training rank first calls the hooks (tp_plan comes between convert and hf_names under TP): hf_names
# when the load plan's initial HF weights are read into the materialised model.
ORDER = ["check", "convert", "hf_names", "after_load", "param_groups", "state", "before_step", "extra_loss",
         "after_optimizer_step", "metrics", "export_state_dict", "export"]


def hooks_of(run: Run, rank: int = 0) -> list[tuple[str, str]]:
    """(hook, detail) in the order training rank `rank` first called them."""
    found = []
    for line in run.output.splitlines():
        m = HOOK_LINE.match(line)
        if m and int(m.group(1)) == rank:
            found.append((m.group(2), m.group(3)))
    return found


def toy_scalars(run: Run, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(run.dump_folder / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return one_window_dataset(tmp_path_factory.mktemp("data"), 8 * (STEPS + 3), SEQ_LEN)


@pytest.fixture(scope="module")
def hf_start(data, tmp_path_factory) -> Path:
    """An HF folder of trained (not freshly initialised) weights that every layout starts from."""
    folder = tmp_path_factory.mktemp("start")
    run = run_train([*data, "--training.steps", "1", "--checkpoint.last_save_in_hf", "--checkpoint.enable"], folder)
    assert run.returncode == 0, run.output[-3000:]
    return folder / "checkpoint" / "step-1-hf"


def start_overrides(hf_start: Path) -> list[str]:
    return ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(hf_start)]


def hf_checksum(folder: Path, keep=lambda name: True) -> float:
    """Sum of every element of the HF tensors whose (titan_lite-side) name passes `keep`."""
    total = 0.0
    for path in sorted(set(weight_files(folder).values())):
        for name, tensor in load_file(str(path)).items():
            if keep(name):
                total += tensor.double().sum().item()
    return total


@pytest.fixture(scope="module")
def single(data, hf_start, tmp_path_factory) -> Run:
    folder = tmp_path_factory.mktemp("single")
    run = run_train([*data, *TOY, *start_overrides(hf_start), "--training.steps", str(STEPS), "--checkpoint.enable",
                     "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false",
                     "--checkpoint.last_save_in_hf"], folder)
    assert run.returncode == 0, run.output[-3000:]
    return run


def test_hooks_run_in_order_and_after_load_sees_the_loaded_weights(single, hf_start):
    hooks = hooks_of(single)
    names = [h for h, _ in hooks]
    assert names == ORDER, names
    assert "tp_plan" not in names  # no tensor parallelism on one process
    assert dict(hooks)["before_step"] == ": step 1"  # first called before the first step's forward
    detail = dict(hooks)["after_load"]
    assert "resuming False" in detail
    checksum = float(re.search(r"checksum (-?[0-9.]+)", detail).group(1))
    assert checksum == pytest.approx(hf_checksum(hf_start), rel=1e-9, abs=1e-6)


def test_gates_train_and_state_metrics_and_export_flow(single, hf_start):
    means, steps = toy_scalars(single, "toy/gate_mean"), toy_scalars(single, "toy/steps")
    assert sorted(steps.items()) == [(s, float(s)) for s in range(1, STEPS + 1)]
    assert means[1] != 1.0 and all(0.0 <= m <= 2.0 for m in means.values())  # trained (own lr), clamped
    root = single.dump_folder / "checkpoint"
    assert json.loads((root / f"toy-gates-step-{STEPS}.json").read_text())["means"][0] == pytest.approx(
        means[STEPS], abs=0.05)
    # The HF export folds the gates into ffn_norm.weight: no toy tensor in it, and the norms changed.
    exported = root / f"step-{STEPS}-hf"
    names = {n for p in set(weight_files(exported).values()) for n in load_file(str(p))}
    assert not any("toy" in n for n in names)
    norm = "model.layers.0.post_attention_layernorm.weight"
    before = load_file(str(weight_files(hf_start)[norm]))[norm]
    after = load_file(str(weight_files(exported)[norm]))[norm]
    assert not torch.equal(before, after)


def test_state_resumes_with_the_run(single, data, hf_start, tmp_path):
    shutil.copytree(single.dump_folder / "checkpoint", tmp_path / "checkpoint")
    run = run_train([*data, *TOY, *start_overrides(hf_start), "--training.steps", str(STEPS + 2),
                     "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"],
                    tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    after_load = dict(hooks_of(run))["after_load"]
    assert "resuming True" in after_load
    steps = toy_scalars(run, "toy/steps")
    assert steps[STEPS + 1] == STEPS + 1 and steps[STEPS + 2] == STEPS + 2  # the counter came back from the checkpoint


LAYOUTS = [
    ("fsdp2", 2, ["--training.local_batch_size", "4"]),
    ("tp2", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2", 2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
]


@pytest.mark.parametrize("name, ngpu, overrides", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_layout_matches_one_process(name, ngpu, overrides, single, data, hf_start, tmp_path):
    run = run_train([*data, *TOY, *start_overrides(hf_start), "--training.steps", str(STEPS), *overrides], tmp_path,
                    ngpu=ngpu)
    # single's folder also holds the resumed steps of test_state_resumes_with_the_run: compare the first STEPS
    assert_losses_close(run, {s: v for s, v in single.tb_losses().items() if s <= STEPS}, atol=1e-5)
    hooks = [h for h, _ in hooks_of(run)]
    assert ("tp_plan" in hooks) == (name == "tp2")
    if name != "pp2":  # a pipeline rank logs the mean of its own stage's gates only
        got, want = toy_scalars(run, "toy/gate_mean"), toy_scalars(single, "toy/gate_mean")
        assert sorted(got) == list(range(1, STEPS + 1)) and all(abs(got[s] - want[s]) < 1e-5 for s in got), (got, want)
    # after_load on every rank saw the weights that rank holds, loaded from the HF folder.
    for rank in range(ngpu):
        detail = dict(hooks_of(run, rank))["after_load"]
        assert "checksum" in detail, run.output[-2000:]
    if name == "fsdp2":  # both ranks hold (shards of) every tensor: the full checksum on each
        for rank in range(ngpu):
            checksum = float(re.search(r"checksum (-?[0-9.]+)", dict(hooks_of(run, rank))["after_load"]).group(1))
            assert checksum == pytest.approx(hf_checksum(hf_start), rel=1e-9, abs=1e-6)
