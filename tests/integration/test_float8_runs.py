"""float8 training ('quantize.linear.float8') through run_train.sh: FSDP with the float8 all-gather and the scale
precompute, HSDP, TP, AC and compile against the 1-process float8 run on the same global batch; LoRA on a float8
base; an exact resume, high-precision checkpoints and an HF export that transformers loads as a plain Llama.

Tolerances. A layout that sees each activation whole (TP: sequence-parallel gathers before each linear, so torchao's
tensorwise scale is the global one) matches the 1-process run up to summation order, which can flip a float8
rounding: measured 2.3e-4 at step 6, so TP_ATOL = 5e-4. Where each rank (FSDP, CP)
or each microbatch (PP) casts only its own slice of the batch, its activation and gradient scales are those of the
slice, so float8 rounds differently: measured up to 1.1e-3 over the first 5 steps (tiny model, 8 x 64 tokens) and
2.04e-3 at step 6 under CP 2 (torch 2.13, torchao 0.18.0), so SLICED_ATOL = 3e-3. For scale, float8 itself moves the
step-5 loss by 2.1e-3 against the same run without it; the exact-layout checks without float8 are 1e-5.
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.integration.harness import CKPT, Run, assert_losses_close, one_window_dataset, run_train
from titan_lite.checkpoint.hf import weight_files

SEQ_LEN, GLOBAL_BATCH, STEPS = 64, 8, 6
TP_ATOL, SLICED_ATOL = 5e-4, 3e-3
F8 = "quantize.linear.float8"
FLOAT8 = ["--model.converters", F8]
ALL_GATHER = [f"--{F8}.enable_fsdp_float8_all_gather", f"--{F8}.precompute_float8_dynamic_scale_for_fsdp"]
SAVES = [*CKPT, "--checkpoint.interval", "3", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
         "false"]
TINY_LINEARS = 4 * 7  # layers x projections; the output head is left out by default
CONVERTED = f"{F8}: {TINY_LINEARS} linear(s) in float8"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("data")
    return [*one_window_dataset(folder, GLOBAL_BATCH * (STEPS + 1), SEQ_LEN), "--training.steps", str(STEPS)]


@pytest.fixture(scope="module")
def reference_run(data, tmp_path_factory) -> Run:
    """One process, the float8 all-gather and precompute switched on (inert without FSDP), batch 8; saves at step 3
    and at the end (training state and an HF export)."""
    run = run_train([*data, *FLOAT8, *ALL_GATHER, "--training.local_batch_size", "8", *SAVES],
                    tmp_path_factory.mktemp("reference"))
    assert run.returncode == 0, run.output[-3000:]
    assert CONVERTED in run.output and f"{F8}: 1 linear(s) left in high precision: output (filter_fqns)" in run.output
    assert "on CPU the float8 matmul is emulated" in run.output
    return run


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[int, float]:
    losses = reference_run.tb_losses()
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(5.0 < v < 9.0 for v in losses.values()), losses
    return losses


def parity(data: list[str], folder: Path, ngpu: int, local_batch: int, extra: list[str]) -> Run:
    run = run_train([*data, *FLOAT8, "--training.local_batch_size", str(local_batch), *extra], folder, ngpu=ngpu)
    assert run.returncode == 0, run.output[-3000:]
    return run


def test_fsdp2_float8_all_gather_and_precompute(data, reference, tmp_path):
    """The issue's acceptance command: 2 FSDP ranks, float8 all-gather (moved as bytes over gloo), precompute."""
    run = parity(data, tmp_path, 2, 4, ["--parallelism.data_parallel_shard_degree", "2", *ALL_GATHER])
    assert "dp_shard 2" in run.output and CONVERTED in run.output
    assert "tensorwise, float8 all-gather with scale precompute, emulated" in run.output
    assert_losses_close(run, reference, SLICED_ATOL)


# (processes, local batch, overrides, tolerance): each with the global batch of 8 sequences per step. PP and CP
# are not among them (the suite's time): float8 has no code of its own there (a stage or a sequence shard runs the
# converted linears as one process does), and tests/integration/test_pipeline_parity.py and test_cp_parity.py check
# those layouts against one process.
CASES = [
    pytest.param(2, 8, ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
                        "--activation_checkpoint.selective_ac_option", "op"], TP_ATOL, id="tp2_ac_selective_op"),
    pytest.param(4, 2, ["--parallelism.data_parallel_replicate_degree", "2", *ALL_GATHER], SLICED_ATOL,
                 id="hsdp2x2_all_gather", marks=pytest.mark.slow),
    # aot_eager: dynamo and AOTAutograd trace the float8 weights under FSDP2 as inductor would get them, without its
    # C++ builds (the GPU lane compiles float8 with inductor)
    pytest.param(2, 4, ["--compile.enable", "--compile.backend", "aot_eager", *ALL_GATHER], SLICED_ATOL,
                 id="fsdp2_compile", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("ngpu, local_batch, extra, atol", CASES)
def test_layout_matches_one_process(ngpu, local_batch, extra, atol, data, reference, tmp_path):
    run = parity(data, tmp_path, ngpu, local_batch, extra)
    assert CONVERTED in run.output
    assert_losses_close(run, reference, atol)


@pytest.mark.slow
def test_lora_on_a_float8_base_under_tp(data, tmp_path):
    """LoRA listed before float8: the adapters' frozen bases run float8 matmuls; TP 2 matches 1 process."""
    lora = ["--model.converters", f"lora,{F8}", "--lora.rank", "4"]
    one = parity(data, tmp_path / "one", 1, 8, lora)
    tp2 = parity(data, tmp_path / "tp2", 2, 8, [*lora, "--parallelism.tensor_parallel_degree", "2"])
    assert CONVERTED in one.output and "lora: trainable" in one.output
    assert_losses_close(tp2, one.tb_losses(), TP_ATOL)


def test_resume_is_exact_and_checkpoints_and_export_are_high_precision(data, reference_run, reference, tmp_path):
    """A run from the reference's step-3 save replays steps 4-6 bitwise; the saves hold plain fp32 tensors; the HF
    export is a plain Llama's (transformers loads it, no missing or unexpected keys) with the trained weights."""
    saves = reference_run.dump_folder / "checkpoint"
    shutil.copytree(saves / "step-3", tmp_path / "checkpoint" / "step-3")
    resumed = run_train([*data, *FLOAT8, *ALL_GATHER, "--training.local_batch_size", "8", *SAVES], tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"loaded checkpoint {tmp_path / 'checkpoint' / 'step-3'}" in resumed.output
    again = resumed.tb_losses()
    assert {s: reference[s] for s in range(4, STEPS + 1)} == {s: again[s] for s in range(4, STEPS + 1)}

    saved = tmp_path / "final.pt"
    dcp_to_torch_save(saves / f"step-{STEPS}", saved)
    model = torch.load(saved, weights_only=True)["model"]  # weights_only: plain tensors, no torchao subclass
    assert {type(v) for v in model.values()} == {torch.Tensor}
    assert {v.dtype for v in model.values()} == {torch.float32}, "checkpoints hold high-precision weights"
    hf_folder = saves / f"step-{STEPS}-hf"
    hf = {n: t for path in sorted(set(weight_files(hf_folder).values())) for n, t in load_file(str(path)).items()}
    assert hf["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32  # q/k are permuted for HF's RoPE
    assert torch.equal(hf["model.layers.0.self_attn.o_proj.weight"], model["layers.0.attention.wo.weight"])
    assert torch.equal(hf["model.layers.3.mlp.down_proj.weight"], model["layers.3.feed_forward.w2.weight"])

    from transformers import LlamaForCausalLM

    loaded, info = LlamaForCausalLM.from_pretrained(hf_folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert sum(p.numel() for p in loaded.parameters()) == sum(v.numel() for v in model.values())


def test_float8_on_a_pruned_base_keeps_the_masks(tmp_path):
    """Sparse fine-tuning: masks from 'prune', float8 matmuls after it; no pruned weight comes back."""
    run = run_train(["--model.converters", f"prune,{F8}", "--pruning.pattern", "2:4", "--pruning.nsamples", "8",
                     "--pruning.seq_len", "64", "--training.steps", "3", *ALL_GATHER,
                     "--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2"],
                    tmp_path, ngpu=2)
    assert run.returncode == 0, run.output[-3000:]
    assert CONVERTED in run.output
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {e.value for e in acc.Scalars("pruning/mask_violations")} == {0.0}
    assert {e.value for e in acc.Scalars("pruning/sparsity")} == {0.5}


def test_a_combination_torchao_cannot_serve_is_one_line_before_launch(tmp_path):
    run = run_train([*FLOAT8, f"--{F8}.recipe_name", "rowwise", f"--{F8}.enable_fsdp_float8_all_gather"],
                    tmp_path, ngpu=2)
    assert run.returncode == 2
    assert run.output.strip() == (f"error: '{F8}.enable_fsdp_float8_all_gather' needs recipe_name 'tensorwise' (the "
                                  "weight is cast with one scale before the all-gather), but recipe_name is 'rowwise'")
