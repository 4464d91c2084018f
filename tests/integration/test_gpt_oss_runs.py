"""gpt-oss (tiny_gpt_oss: sinks, all four attention biases, the biased router, clamped SwiGLU experts with biases, a
16-token window under 64-token sequences) through run_train.sh, from one HF folder whose sinks and biases are drawn
far from their zero init: FSDP 2 with full activation checkpointing, FSDP 2 with selective AC and compile, EP 2 (the
biased experts sharded by expert, the router's bias replicated), TP 2 (the sinks split by head with q's rows, o's
bias added once after the reduction, router and experts replicated), CP 2 (the sinks and the window in the gathered
attention, on global positions) and PP 2 (two stages of a sliding and a full layer each) each equal one process on
the same global batch: the losses, the aux loss and every MoE layer's load within 1e-5."""

import pytest

from tests.integration.harness import one_window_dataset, run_train, wide_gpt_oss_folder
from tests.integration.test_moe_parity import scalars

pytestmark = pytest.mark.slow

SEQ_LEN, GLOBAL_BATCH, STEPS, ATOL = 64, 8, 4, 1e-5
# the aux loss weighted enough that a wrong share of its gradient would move the losses
COMMON = ["--model.flavor", "tiny_gpt_oss", "--training.steps", str(STEPS), "--model.router_aux_loss_coef", "0.1"]
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    folder = wide_gpt_oss_folder(tmp_path_factory.mktemp("gpt_oss") / "hf")
    return [*one_window_dataset(tmp_path_factory.mktemp("data"), GLOBAL_BATCH * (STEPS + 1), SEQ_LEN), *COMMON,
            "--model.hf_assets_path", folder, "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path",
            folder]


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one_process")
    run = run_train([*data, "--training.local_batch_size", str(GLOBAL_BATCH)], folder)
    series = scalars(folder)
    assert run.returncode == 0 and sorted(series["loss/global_avg"]) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert "moe/aux_loss" in series and all(5.0 < v < 9.0 for v in series["loss/global_avg"].values()), series
    return series


# (id, processes, local batch, overrides, the layout the start-up line must name)
LAYOUTS = [
    ("fsdp2_full_ac", 2, 4, ["--activation_checkpoint.mode", "full"], "dp_shard 2 x cp 1 x tp 1 x pp 1"),
    ("fsdp2_selective_ac_compile", 2, 4,
     ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
      "--compile.enable", "--compile.backend", "aot_eager"], "dp_shard 2 x cp 1 x tp 1 x pp 1"),
    ("ep2", 2, 4, ["--parallelism.expert_parallel_degree", "2"], "(experts: ep 2 x efsdp 1)"),
    ("tp2", 2, 8, ["--parallelism.tensor_parallel_degree", "2"], "dp_shard 1 x cp 1 x tp 2 x pp 1"),
    ("cp2", 2, 8, ["--parallelism.context_parallel_degree", "2"], "dp_shard 1 x cp 2 x tp 1 x pp 1"),
    ("pp2_1f1b", 2, 8, ["--parallelism.pipeline_parallel_degree", "2",
                        "--parallelism.pipeline_parallel_microbatch_size", "2"], "dp_shard 1 x cp 1 x tp 1 x pp 2"),
]


@pytest.mark.parametrize("name, ngpu, local_batch, overrides, layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_gpt_oss_layout_equals_one_process(name, ngpu, local_batch, overrides, layout, data, one_process, tmp_path):
    run = run_train([*data, "--training.local_batch_size", str(local_batch), *overrides], tmp_path, ngpu=ngpu)
    assert run.returncode == 0 and layout in run.output, run.output[-3000:]
    got = scalars(tmp_path)
    assert sorted(got) == sorted(one_process)
    worst = max(abs(got[series][step] - value) for series, values in one_process.items()
                for step, value in values.items())
    print(f"{name}: largest difference from one process {worst:.3g} over {len(one_process)} series")
    for series, values in one_process.items():
        for step, value in values.items():
            assert abs(got[series][step] - value) <= ATOL, f"{series} step {step}: {got[series][step]} vs {value}"
