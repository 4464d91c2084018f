"""A Qwen3-MoE (tiny_moe: 3 MoE layers, one dense) trained through run_train.sh under each parallel layout equals one
process: the losses, the aux loss and every MoE layer's expert load, over 5 steps, within 1e-5.

The aux-loss weight is raised to 0.1 so that a wrong share of its gradient on any layout would move the losses. The
corpus has documents of exactly seq_len + 1 tokens, so every split of the global batch of 8 reads the same sequences
(see test_parallel_parity.py).
"""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import one_window_dataset, run_train

pytestmark = pytest.mark.slow

SEQ_LEN, GLOBAL_BATCH, STEPS = 64, 8, 5
ATOL = 1e-5
MOE = ["--model.flavor", "tiny_moe", "--model.router_aux_loss_coef", "0.1"]


def scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar series the run wrote to TensorBoard whose name is the loss or starts with moe/."""
    acc = EventAccumulator(str(folder / "tb"))
    acc.Reload()
    names = [n for n in acc.Tags()["scalars"] if n == "loss/global_avg" or n.startswith("moe/")]
    return {n: {e.step: e.value for e in acc.Scalars(n)} for n in names}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    docs = GLOBAL_BATCH * (STEPS + 1)
    return [*one_window_dataset(tmp_path_factory.mktemp("data"), docs, SEQ_LEN), "--training.steps", str(STEPS),
            *MOE]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[str, dict[int, float]]:
    folder = tmp_path_factory.mktemp("reference")
    run = run_train([*data, "--training.local_batch_size", "8"], folder, ngpu=1)
    assert run.returncode == 0, run.output[-3000:]
    series = scalars(folder)
    assert {"moe/aux_loss", "moe/load_max_over_mean", "moe/load_max_over_mean/layer_0",
            "moe/load_max_over_mean/layer_3"} <= set(series) and "moe/load_max_over_mean/layer_1" not in series
    assert all(1.9 < v < 2.5 for v in series["moe/aux_loss"].values())  # k = 2 when balanced
    return series


# (id, processes, local batch, overrides, start-up line): a global batch of 8 each.
LAYOUTS = [
    ("fsdp2_ac_full_accumulation2", 2, 2, ["--activation_checkpoint.mode", "full", "--training.global_batch_size",
                                           "8"], "dp_shard 2 x cp 1 x tp 1 x pp 1; gradient accumulation 2"),
    ("tp2", 2, 8, ["--parallelism.tensor_parallel_degree", "2"], "dp_shard 1 x cp 1 x tp 2"),
    ("pp2", 2, 8, ["--parallelism.pipeline_parallel_degree", "2"], "tp 1 x pp 2"),
    ("cp2", 2, 8, ["--parallelism.context_parallel_degree", "2"], "cp 2 x tp 1"),
    # aot_eager: dynamo and AOTAutograd trace the routed experts as inductor would get them, without its C++ builds
    ("compile", 1, 8, ["--compile.enable", "--compile.backend", "aot_eager"], "world 1"),
]


@pytest.mark.parametrize("name, ngpu, local_batch, overrides, layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_moe_layout_equals_one_process(name, ngpu, local_batch, overrides, layout, data, reference,
                                       tmp_path_factory):
    folder = tmp_path_factory.mktemp(name)
    run = run_train([*data, "--training.local_batch_size", str(local_batch), *overrides], folder, ngpu=ngpu)
    assert run.returncode == 0, run.output[-3000:]
    assert layout in run.output
    got = scalars(folder)
    assert sorted(got) == sorted(reference)
    for series, values in reference.items():
        for step, value in values.items():
            assert abs(got[series][step] - value) <= ATOL, f"{series} step {step}: {got[series][step]} vs {value}"


def test_lora_on_experts_under_fsdp_equals_one_process(data, tmp_path_factory):
    """LoRA on attention and experts (grouped adapters sharded by FSDP with the experts): 2 ranks x 4 sequences
    equal 1 x 8."""
    lora = ["--model.converters", "lora", "--lora.target_modules", "wq,experts", "--lora.rank", "4"]
    series = []
    for name, ngpu, local_batch in (("lora_one", 1, 8), ("lora_fsdp2", 2, 4)):
        folder = tmp_path_factory.mktemp(name)
        run = run_train([*data, *lora, "--training.local_batch_size", str(local_batch)], folder, ngpu=ngpu)
        assert run.returncode == 0, run.output[-3000:]
        series.append(scalars(folder))
    one, fsdp = series
    assert sorted(one) == sorted(fsdp) and len(one["loss/global_avg"]) == STEPS
    for name, values in one.items():
        for step, value in values.items():
            assert abs(fsdp[name][step] - value) <= ATOL, f"{name} step {step}: {fsdp[name][step]} vs {value}"
