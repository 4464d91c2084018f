"""Gemma 3 (text) through run_train.sh: FSDP with activation checkpointing and compile, TP 2 (q/k norms replicated,
the four sandwich norms on sequence shards), CP 2 (each layer's window on global positions, each layer type's rope)
and PP 2 (the scaled embedding on the first stage, the per-layer-type rope on each) equal one process on the same
global batch within 1e-5 over several steps. Every run starts from one HF folder of tiny_gemma3 whose norm weights
are drawn far from their (1 + w) default, so a norm placed, sharded or skipped wrongly shows."""

from pathlib import Path

import pytest
import torch

from tests.integration.harness import REPO, assert_losses_close, one_window_dataset, run_train

SEQ_LEN = 64  # the sliding layers' window is 8: well inside every sequence and every CP shard
GLOBAL_BATCH = 8
STEPS = 4
ATOL = 1e-5


def wide_gemma3_folder(folder: Path) -> str:
    """tiny_gemma3 (untied, for pipeline stages) as an HF Gemma3ForCausalLM folder with the bundled tokenizer; every
    norm weight ~ N(0, 0.5) and every other weight perturbed."""
    from titan_lite.checkpoint.hf import write_hf_folder
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    args = flavor_args("tiny_gemma3")
    model = Llama(args)
    model.init_weights(seed=5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if name.endswith("norm.weight") else 0.02
            param.add_(scale * torch.randn(param.shape, generator=generator))
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32, str(REPO / "assets/tokenizer"))
    return str(folder)


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    folder = wide_gemma3_folder(tmp_path_factory.mktemp("gemma3") / "hf")
    data = one_window_dataset(tmp_path_factory.mktemp("data"), GLOBAL_BATCH * (STEPS + 1), SEQ_LEN)
    return [*data, "--training.steps", str(STEPS), "--model.name", "gemma3", "--model.flavor", "tiny_gemma3",
            "--model.hf_assets_path", folder, "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path",
            folder]


@pytest.fixture(scope="module")
def reference(common, tmp_path_factory) -> dict[int, float]:
    run = run_train([*common, "--training.local_batch_size", str(GLOBAL_BATCH)], tmp_path_factory.mktemp("one"))
    losses = run.tb_losses()
    assert run.returncode == 0 and sorted(losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert all(5.0 < v < 9.0 for v in losses.values()), losses
    return losses


# (id, local batch, overrides, the layout the start-up line must name): 2 processes each
CASES = [
    ("fsdp2_full_ac_compile", 4, ["--activation_checkpoint.mode", "full", "--compile.enable", "--compile.backend",
                                  "aot_eager"], "dp_replicate 1 x dp_shard 2 x cp 1 x tp 1"),
    ("tp2_selective_ac", 8, ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op"],
     "dp_replicate 1 x dp_shard 1 x cp 1 x tp 2"),
    ("cp2", 8, ["--parallelism.context_parallel_degree", "2"], "dp_replicate 1 x dp_shard 1 x cp 2 x tp 1"),
    ("pp2_1f1b", 8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
                     "2"], "dp_shard 1 x cp 1 x tp 1 x pp 2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, local_batch, overrides, layout", CASES, ids=[c[0] for c in CASES])
def test_gemma3_layout_matches_one_process(name, local_batch, overrides, layout, common, reference, tmp_path):
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"} if "--compile.enable" in overrides else None
    run = run_train([*common, "--training.local_batch_size", str(local_batch), *overrides], tmp_path, ngpu=2, env=env)
    assert layout in run.output, run.output[-3000:]
    assert_losses_close(run, reference, ATOL)
