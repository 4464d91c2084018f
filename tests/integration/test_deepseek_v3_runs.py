"""DeepSeek-V3 (debugmodel_deepseek_v3: latent attention, layer 0 dense, 8 experts in 4 groups plus a shared one)
through run_train.sh: FSDP 2 with full AC and compile, EP 2, CP 2, PP 2 and FSDP 2 x TP 2 equal one process over 5
steps (the losses, the sequence-wise aux loss and every MoE layer's expert load within 1e-5), with the correction
biases moved by the aux-loss-free rule each step (gamma 0.01, so a bias moved from one rank's loads alone would
change the routing); the exported biases of FSDP 2 equal one process's, moved off zero and centred. One-window
documents: every split of the global batch of 8 reads the same sequences (see test_parallel_parity.py)."""

import pytest
import torch

from tests.integration.harness import REPO, one_window_dataset, run_train
from tests.integration.test_moe_parity import scalars

pytestmark = pytest.mark.slow

SEQ_LEN, GLOBAL_BATCH, STEPS, ATOL = 64, 8, 5, 1e-5
DEEPSEEK = ["--model.flavor", "debugmodel_deepseek_v3", "--model.router_aux_loss_coef", "0.01",
            "--model.load_balance_coeff", "0.01"]
EXPORT = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS), "--checkpoint.last_save_in_hf"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    docs = GLOBAL_BATCH * (STEPS + 1)
    return [*one_window_dataset(tmp_path_factory.mktemp("data"), docs, SEQ_LEN), "--training.steps", str(STEPS),
            *DEEPSEEK]


def biases(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(folder / "checkpoint" / f"step-{STEPS}-hf" / "model.safetensors")
    return {name: t for name, t in tensors.items() if name.endswith("e_score_correction_bias")}


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one_process")
    run = run_train([*data, "--training.local_batch_size", "8", *EXPORT], folder, ngpu=1)
    assert run.returncode == 0, run.output[-3000:]
    series = scalars(folder)
    assert {"moe/aux_loss", "moe/load_max_over_mean/layer_1", "moe/load_max_over_mean/layer_3"} <= set(series)
    assert "moe/load_max_over_mean/layer_0" not in series  # the dense layer
    return folder, series


@pytest.mark.parametrize("name, ngpu, overrides, layout", [
    # full AC recomputes every block in the backward: the loads must be counted once; compiled per block (the latent
    # path, the group router's top-k traced), aot_eager as the other families' compile runs (inductor equals one
    # process too, but compiles for minutes on a shared 2-core CPU)
    ("fsdp2_ac_full_compile", 2, [*EXPORT, "--activation_checkpoint.mode", "full", "--compile.enable",
                                  "--compile.backend", "aot_eager"], "dp_shard 2 x cp 1 x tp 1 x pp 1;"),
    ("ep2", 2, ["--parallelism.expert_parallel_degree", "2"], "(experts: ep 2 x efsdp 1)"),
    # K/V expanded from each rank's latent, all-gathered; the load balancer's head-tail chunks, RoPE at global positions
    ("cp2", 2, ["--parallelism.context_parallel_degree", "2"], "dp_shard 1 x cp 2 x tp 1"),
    ("pp2", 2, ["--parallelism.pipeline_parallel_degree", "2"], "tp 1 x pp 2"),
    # heads split over TP 2 (the shared rope key's gradient summed over them), FSDP 2 over the replicated parts
    ("fsdp2_tp2", 4, ["--parallelism.tensor_parallel_degree", "2"], "dp_shard 2 x cp 1 x tp 2"),
])
def test_layout_equals_one_process_with_the_bias_updates(name, ngpu, overrides, layout, data, reference, tmp_path):
    local_batch = {"cp2": 8, "pp2": 8, "fsdp2_tp2": 4}.get(name, 8 // ngpu)
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"} if "--compile.enable" in overrides else None
    run = run_train([*data, "--training.local_batch_size", str(local_batch), *overrides], tmp_path, ngpu=ngpu,
                    env=env)
    assert run.returncode == 0 and layout in run.output, run.output[-3000:]
    folder, expected = reference
    got = scalars(tmp_path)
    assert sorted(got) == sorted(expected)
    for series, values in expected.items():
        for step, value in values.items():
            assert abs(got[series][step] - value) <= ATOL, f"{series} step {step}: {got[series][step]} vs {value}"
    if name != "fsdp2_ac_full_compile":
        return
    ours, theirs = biases(tmp_path), biases(folder)
    assert sorted(ours) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)]
    for key, bias in theirs.items():
        torch.testing.assert_close(ours[key], bias, rtol=0, atol=1e-7)
        assert bias.abs().max() > 0.005 and abs(float(bias.sum())) < 1e-5  # moved, each move centred


# ------------------------------------------------------------------------------------------ distillation


def test_distillation_from_a_deepseek_v3_teacher_folder(data, tmp_path):
    """The teacher assembled from the DeepSeek-V3 folder the student also starts from: at step 1 both give the same
    logits (KL exactly 0: the teacher's latent attention, group routing and correction biases are the student's);
    the logged parts make up the loss, alpha T^2 KL + (1 - alpha) CE, and training moves the student away."""
    from tests.integration.test_distill_runs import scalars as tb_scalars
    from titan_lite.checkpoint.hf import write_hf_folder
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    args = flavor_args("debugmodel_deepseek_v3")
    model = Llama(args)
    model.init_weights(seed=5)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(1)))
    teacher = tmp_path / "teacher"
    write_hf_folder(model.state_dict(), args, str(teacher), torch.float32, str(REPO / "assets/tokenizer"))
    run = run_train([*data, "--training.local_batch_size", "8", "--model.hf_assets_path", str(teacher),
                     "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(teacher),
                     "--distill.enable", "--distill.alpha", "0.5", "--distill.temperature", "2",
                     "--distill.teacher_path", str(teacher)], tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    losses, kl, ce = run.tb_losses(), tb_scalars(run, "distill/kl"), tb_scalars(run, "distill/ce")
    assert sorted(losses) == sorted(kl) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - (0.5 * 4 * kl[step] + 0.5 * ce[step])) < 1e-5, (step, loss, kl[step], ce[step])
    assert kl[1] == 0.0 and kl[STEPS] > 0, kl
