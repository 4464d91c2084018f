"""LoRA through run_train.sh (PiSSA + rsLoRA + DoRA from an HF folder): 1 process against FSDP 2 (+ AC), TP 2 (+ op AC
+ compile) and PP 2 (losses, gradient norms and the trained adapters), the trainable set each rank reports after every
parallelism, the frozen base bitwise unchanged, and the exact resume of an adapter-only checkpoint."""

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemReader

from tests.integration.harness import (
    ADAPTER_EXPORT,
    Run,
    assert_losses_close,
    one_window_dataset,
    perturbed_hf_folder,
    run_train,
)

SEQ_LEN, STEPS = 32, 4
LORA = ["--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8", "--lora.init", "pissa",
        "--lora.use_rslora", "--lora.use_dora", "--training.local_batch_size", "4"]
ADAPTER_TENSORS = 4 * 7 * 3  # layers x projections x (A, B, magnitude)
TRAINABLE = re.compile(r"\[rank(\d)\]:.*lora: trainable = (\d+) adapter tensors .* \+ 0 train_modules")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return one_window_dataset(tmp_path_factory.mktemp("data"), 4 * (STEPS + 2), SEQ_LEN)


@pytest.fixture(scope="module")
def hf_start(tmp_path_factory) -> Path:
    """The tiny model with perturbed weights, as an HF folder every run starts from."""
    return perturbed_hf_folder(tmp_path_factory.mktemp("start") / "hf", "tiny")


def start(hf_start: Path) -> list[str]:
    return ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(hf_start)]


def grad_norms(run: Run) -> dict[int, float]:
    acc = EventAccumulator(str(run.dump_folder / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("grad_norm")}


def adapter(run: Run) -> dict[str, torch.Tensor]:
    return load_file(str(run.dump_folder / "checkpoint" / f"step-{STEPS}-adapter" / "adapter_model.safetensors"))


def trainable_counts(run: Run) -> dict[int, int]:
    return {int(r): int(n) for r, n in TRAINABLE.findall(run.output)}


@pytest.fixture(scope="module")
def single(data, hf_start, tmp_path_factory) -> Run:
    run = run_train([*data, *LORA, *start(hf_start), "--training.steps", str(STEPS), *ADAPTER_EXPORT,
                     "--checkpoint.interval", "2"], tmp_path_factory.mktemp("single"))
    assert run.returncode == 0, run.output[-3000:]
    return run


def test_single_process_trains_only_adapters_and_exports(single):
    assert trainable_counts(single) == {0: ADAPTER_TENSORS}
    assert "lora: the optimizer holds 84 tensors, exactly the trainable ones" in single.output
    assert "frozen tensors on this rank are bitwise unchanged since loading" in single.output
    folder = single.dump_folder / "checkpoint"
    for name in (f"step-{STEPS}-adapter", f"step-{STEPS}-pissa-adapter", f"step-{STEPS}-pissa-residual-base"):
        assert (folder / name).is_dir(), name
    assert adapter(single)["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 64)


def test_checkpoints_hold_only_the_adapters(single):
    keys = FileSystemReader(str(single.dump_folder / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == ADAPTER_TENSORS + 2 * 28  # adapters and PiSSA's initial factors, no base weight
    assert all(k.rsplit(".", 1)[1] in ("lora_a", "lora_b", "magnitude", "pissa_a0", "pissa_b0") for k in model_keys)
    assert any(k.startswith("optimizer.") for k in keys)


LAYOUTS = [  # with activation checkpointing and compile on some: the trainable set must survive them too
    ("fsdp2", ["--training.local_batch_size", "2", "--activation_checkpoint.mode", "full"]),
    ("tp2", ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.backend", "aot_eager",
             "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    ("pp2", ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
]


@pytest.mark.parametrize("name, overrides", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_layout_matches_one_process(name, overrides, single, data, hf_start, tmp_path):
    run = run_train([*data, *LORA, *start(hf_start), "--training.steps", str(STEPS), *ADAPTER_EXPORT, *overrides],
                    tmp_path, ngpu=2)
    assert_losses_close(run, single.tb_losses(), atol=1e-5)
    ours, theirs = grad_norms(run), grad_norms(single)
    assert all(abs(ours[s] - theirs[s]) <= 1e-5 * theirs[s] for s in theirs), (ours, theirs)
    want = adapter(single)
    got = adapter(run)
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert torch.allclose(got[key], tensor, atol=1e-5), (key, (got[key] - tensor).abs().max())
    counts = trainable_counts(run)
    if name == "pp2":  # each stage holds its own layers' adapters
        assert sorted(counts) == [0, 1] and sum(counts.values()) == ADAPTER_TENSORS and min(counts.values()) > 0
    else:
        assert counts == {0: ADAPTER_TENSORS, 1: ADAPTER_TENSORS}
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]:.*lora: the optimizer holds \d+ tensors, exactly the trainable", run.output)
        assert re.search(rf"\[rank{rank}\]:.*frozen tensors on this rank are bitwise unchanged", run.output)


def test_adapter_only_checkpoint_resumes_exactly(single, data, hf_start, tmp_path):
    """Resume at step 2 from the adapter-only checkpoint: the base comes from the HF folder again, PiSSA's SVD is
    recomputed, and steps 3 and 4 (losses and final adapters) equal the uninterrupted run's."""
    shutil.copytree(single.dump_folder / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    run = run_train([*data, *LORA, *start(hf_start), "--training.steps", str(STEPS), *ADAPTER_EXPORT,
                     "--checkpoint.interval", "2"], tmp_path)
    assert "resuming after step 2" in run.output
    assert_losses_close(run, {s: v for s, v in single.tb_losses().items() if s > 2}, atol=1e-6)
    want = adapter(single)
    assert all(torch.equal(adapter(run)[k], t) for k, t in want.items())
