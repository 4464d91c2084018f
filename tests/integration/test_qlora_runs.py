"""QLoRA (lora.base_dtype = "nf4", rsLoRA + DoRA adapters) through run_train.sh: one process against HSDP x CP +
AC on 4 ranks and PP 2 (per-step losses), adapter-only and full (DCP) checkpoints that resume exactly with the NF4
base quantized again, QPiSSA's smaller quantization error, and the exports: the PEFT adapter on the original base
(in PEFT) and scripts/merge_lora.py --base_nf4 against the run's own merged export."""

import shutil
import subprocess
from pathlib import Path

import pytest
import tomli
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.integration.harness import (
    ADAPTER_EXPORT,
    REPO,
    Run,
    assert_losses_close,
    one_window_dataset,
    perturbed_hf_folder,
    run_train,
)
from tests.warm_python import python_command

SEQ_LEN, STEPS = 32, 4
FLAVOR = "debugmodel"  # every block linear's shard over 2 ranks holds whole groups of 256 NF4 scales
ADAPTERS = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.use_rslora", "--lora.use_dora"]
QLORA = ["--model.flavor", FLAVOR, "--model.converters", "lora", *ADAPTERS, "--lora.base_dtype", "nf4",
         "--training.local_batch_size", "4"]
NF4_TENSORS = 6 * 7  # layers x projections
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return one_window_dataset(tmp_path_factory.mktemp("data"), 4 * (STEPS + 2), SEQ_LEN)


@pytest.fixture(scope="module")
def hf_start(tmp_path_factory) -> Path:
    """The debug model with perturbed weights, as the HF folder every run starts from."""
    return perturbed_hf_folder(tmp_path_factory.mktemp("start") / "hf", FLAVOR)


def start(hf_start: Path) -> list[str]:
    return ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(hf_start)]


def ckpt(run: Run, name: str) -> Path:
    return run.dump_folder / "checkpoint" / name


@pytest.fixture(scope="module")
def single(data, hf_start, tmp_path_factory) -> Run:
    run = run_train([*data, *QLORA, *start(hf_start), "--training.steps", str(STEPS), "--checkpoint.enable",
                     "--checkpoint.interval", "2", "--checkpoint.last_save_in_hf"], tmp_path_factory.mktemp("single"))
    assert run.returncode == 0, run.output[-3000:]
    return run


def test_one_process_quantizes_every_block_linear_and_saves_no_base(single):
    assert f"lora: {NF4_TENSORS} frozen block linears on this rank quantized to NF4 (QLoRA)" in single.output
    assert "frozen tensors on this rank are bitwise unchanged since loading" in single.output
    keys = FileSystemReader(str(ckpt(single, "step-2"))).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == NF4_TENSORS * 3  # lora_a, lora_b, magnitude: the NF4 base is never saved
    assert all(k.rsplit(".", 1)[1] in ("lora_a", "lora_b", "magnitude") for k in model_keys)


def test_hsdp_cp_ac_on_4_ranks_matches_one_process(single, data, hf_start, tmp_path):
    """Replicas 2 x FSDP over CP 2 (the 4-bit all-gather, each rank quantizing its own shard), full AC."""
    run = run_train([*data, *QLORA, *start(hf_start), "--training.steps", str(STEPS), "--training.local_batch_size",
                     "2", "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.context_parallel_degree",
                     "2", "--activation_checkpoint.mode", "full"], tmp_path, ngpu=4)
    assert_losses_close(run, single.tb_losses(), atol=1e-5)
    for rank in range(4):
        assert f"[rank{rank}]:" in run.output
    assert run.output.count(f"lora: {NF4_TENSORS} frozen block linears on this rank quantized to NF4") == 4


def test_per_block_compile_matches_eager(single, data, hf_start, tmp_path):
    """torch.compile (inductor, per block) traces the NF4 weights' dequantization: the eager run's losses."""
    run = run_train([*data, *QLORA, *start(hf_start), "--training.steps", str(STEPS), "--compile.enable"], tmp_path,
                    env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    assert_losses_close(run, single.tb_losses(), atol=1e-5)
    assert tomli.loads((run.dump_folder / "config.toml").read_text())["compile"]["enable"] is True


def test_pp2_matches_one_process_and_its_full_checkpoint_resumes_exactly(single, data, hf_start, tmp_path):
    """PP 2 with full checkpoints (save_adapter_only = false, through DCP): the NF4 base is still never saved, so
    the resume at step 2 loads the initial weights, quantizes them again and continues with the same losses."""
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
          "--lora.save_adapter_only", "false", "--checkpoint.enable", "--checkpoint.interval", "2"]
    first = run_train([*data, *QLORA, *start(hf_start), "--training.steps", str(STEPS), *pp], tmp_path / "a", ngpu=2)
    assert_losses_close(first, single.tb_losses(), atol=1e-5)
    keys = FileSystemReader(str(ckpt(first, "step-2"))).read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in keys and "model.layers.0.attention.wq.lora_a" in keys
    assert "model.layers.0.attention.wq.weight" not in keys
    shutil.copytree(ckpt(first, "step-2"), tmp_path / "b" / "checkpoint" / "step-2")
    resumed = run_train([*data, *QLORA, *start(hf_start), "--training.steps", str(STEPS), *pp], tmp_path / "b",
                        ngpu=2)
    assert "resuming after step 2" in resumed.output
    assert_losses_close(resumed, {s: v for s, v in first.tb_losses().items() if s > 2}, atol=1e-6)


def test_adapter_only_checkpoint_resumes_exactly(single, data, hf_start, tmp_path):
    shutil.copytree(ckpt(single, "step-2"), tmp_path / "checkpoint" / "step-2")
    run = run_train([*data, *QLORA, *start(hf_start), "--training.steps", str(STEPS), *ADAPTER_EXPORT,
                     "--checkpoint.interval", "2"], tmp_path)
    assert "resuming after step 2" in run.output
    assert_losses_close(run, {s: v for s, v in single.tb_losses().items() if s > 2}, atol=1e-6)
    want = load_file(str(ckpt(single, f"step-{STEPS}-adapter") / "adapter_model.safetensors"))
    got = load_file(str(ckpt(run, f"step-{STEPS}-adapter") / "adapter_model.safetensors"))
    assert all(torch.equal(got[k], t) for k, t in want.items())


def test_qpissa_quantizes_a_residual_closer_to_the_full_precision_weights(data, hf_start, tmp_path):
    """QLoRA starts from NF4(W) (B = 0); QPiSSA from NF4(W - s B0 A0) + s B0 A0, PiSSA's top singular directions
    kept out of the quantization. Each run's merged export after one step that changes nothing is its start:
    QPiSSA's is nearer the full-precision weights (the schedule's only step has learning rate 0)."""
    one = ["--training.steps", "1", "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable",
           "--checkpoint.last_save_in_hf"]
    original = load_file(str(next(hf_start.glob("*.safetensors"))))
    errors = {}
    for init in ("default", "pissa"):
        run = run_train([*data, *QLORA, "--lora.init", init, *start(hf_start), *one], tmp_path / init)
        assert run.returncode == 0 and "lr: 0.0e+00" in run.output, run.output[-3000:]
        merged = load_file(str(next(ckpt(run, "step-1-hf").glob("*.safetensors"))))
        errors[init] = sum((merged[k].double() - original[k].double()).norm() for k in original if "proj" in k)
    assert 0 < errors["pissa"] < errors["default"], errors


def merge(base: Path, adapter: Path, out: Path, *extra: str) -> str:
    proc = subprocess.run([*python_command(), str(REPO / "scripts/merge_lora.py"), "--base", str(base), "--adapter",
                           str(adapter), "--output_dir", str(out), *extra], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_exports_peft_on_the_original_base_and_merge_onto_the_nf4_base(single, hf_start, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = ckpt(single, f"step-{STEPS}-adapter")
    out = merge(hf_start, adapter, tmp_path / "nf4", "--base_nf4")
    assert f"quantized {NF4_TENSORS} block projections of the base to NF4 and back" in out
    # what the run trained: its own export merged the adapters onto the dequantized NF4 base
    trained = load_file(str(next(ckpt(single, f"step-{STEPS}-hf").glob("*.safetensors"))))
    merged = load_file(str(next((tmp_path / "nf4").glob("*.safetensors"))))
    assert set(merged) == set(trained)
    for key, tensor in trained.items():
        torch.testing.assert_close(merged[key], tensor, atol=1e-5, rtol=0, msg=key)
    # QLoRA's usual deployment: the adapter in PEFT on the original full-precision base = merge onto that base
    merge(hf_start, adapter, tmp_path / "original")
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(hf_start)), str(adapter))
        on_original = AutoModelForCausalLM.from_pretrained(str(tmp_path / "original"))
        on_nf4 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "nf4"))
        want = peft(tokens).logits
        torch.testing.assert_close(on_original(tokens).logits, want, atol=1e-4, rtol=0)
        assert not torch.allclose(on_nf4(tokens).logits, want, atol=1e-4)  # the base differs by NF4's error
