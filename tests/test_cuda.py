"""CUDA correctness (the GPU lane's first case, `pytest -m cuda`): each CUDA path against the CPU or fp32 run of the
same job, through ./run_train.sh and the scripts as users run them. Skipped without CUDA (tests/conftest.py).

TITAN_LITE_CUDA_TESTS_ON_CPU=1 runs them on the CPU in place of the GPU (a check of the tests' own plumbing: both
sides then run the same device, so only the CPU-independent assertions carry weight); nothing else sets it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.harness import CKPT, run_train, steps, tb_losses
from titan_lite.checkpoint.hf import export_hf, write_hf_folder
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args

pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parents[1]
ON_CPU = os.environ.get("TITAN_LITE_CUDA_TESTS_ON_CPU") == "1"
DEVICE = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)
CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}
GPU_ENV = CPU_ENV if ON_CPU else {}
FP32 = ["--training.mixed_precision_param", "float32"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
# Exact comparisons need deterministic kernels on a GPU (cuBLAS asks for a fixed workspace for that).
DETERMINISTIC = ["--debug.deterministic"]
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def losses(folder: Path, overrides: list[str], n: int = 6, env: dict | None = None) -> dict[int, float]:
    run = run_train(steps(n) + overrides, folder, env={**GPU_ENV, **(env or {})})
    assert run.returncode == 0, run.output[-3000:]
    got = run.tb_losses()
    assert sorted(got) == list(range(1, n + 1))
    return got


def cpu_initial_weights(folder: Path) -> list[str]:
    """Overrides that start a run from the tiny flavor's init drawn on the CPU: a CUDA generator draws other numbers
    than the CPU's, so a CUDA-against-CPU comparison starts both sides from one HF folder (transforms' adapters are
    drawn on the CPU on every device)."""
    if not (folder / "config.json").exists():
        args = flavor_args("tiny")
        model = Llama(args)
        model.init_weights(seed=0)
        tokenizer = str(REPO / "assets/tokenizer")
        write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32, tokenizer)
    return ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]


def assert_close(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rel, f"largest relative loss difference {worst:.2e} > {rel:.0e}: {got} vs {want}"


# ------------------------------------------------------------------------------------------ precision


def test_fp32_on_cuda_matches_the_cpu_and_bf16_autocast_tracks_it(tmp_path):
    init = cpu_initial_weights(tmp_path / "init")
    cpu = losses(tmp_path / "cpu", FP32 + init, env=CPU_ENV)
    gpu = losses(tmp_path / "gpu", FP32 + init)
    bf16 = losses(tmp_path / "bf16", BF16 + init)
    assert_close(gpu, cpu, rel=1e-3)
    assert_close(bf16, gpu, rel=3e-2)
    assert bf16 != gpu  # autocast ran: bf16 matmuls round differently


def test_compile_matches_eager(tmp_path):
    backend = ["--compile.backend", "aot_eager"] if ON_CPU else []  # inductor's C++ builds take minutes on a CPU
    eager = losses(tmp_path / "eager", FP32)
    compiled = losses(tmp_path / "compiled", FP32 + ["--compile.enable"] + backend)
    assert_close(compiled, eager, rel=1e-3)


@pytest.mark.parametrize("mode", [["full"], ["selective", "op"], ["selective", "2"]], ids="-".join)
def test_activation_checkpointing_matches_none(tmp_path, mode):
    ac = ["--activation_checkpoint.mode", mode[0]] + (
        ["--activation_checkpoint.selective_ac_option", mode[1]] if len(mode) > 1 else [])
    none = losses(tmp_path / "none", FP32 + DETERMINISTIC, env=DETERMINISTIC_ENV)
    checkpointed = losses(tmp_path / "ac", FP32 + DETERMINISTIC + ac, env=DETERMINISTIC_ENV)
    assert_close(checkpointed, none, rel=1e-5)


def test_dcp_save_and_resume_on_cuda_is_exact(tmp_path):
    env = {**GPU_ENV, **DETERMINISTIC_ENV}
    whole = run_train(steps(10) + FP32 + DETERMINISTIC, tmp_path / "whole", env=env)
    assert whole.returncode == 0, whole.output[-3000:]
    first = run_train(steps(5) + FP32 + DETERMINISTIC + CKPT, tmp_path / "resumed", env=env)
    assert first.returncode == 0, first.output[-3000:]
    second = run_train(steps(10) + FP32 + DETERMINISTIC + CKPT + ["--metrics.save_tb_folder", "tb_resume"],
                       tmp_path / "resumed", env=env)
    assert second.returncode == 0, second.output[-3000:]
    assert "loaded checkpoint" in second.output
    resumed, reference = tb_losses(tmp_path / "resumed" / "tb_resume"), whole.tb_losses()
    assert sorted(resumed) == list(range(6, 11))
    assert resumed == {s: reference[s] for s in range(6, 11)}


# ------------------------------------------------------------------------------------------ transforms


def test_lora_on_cuda_matches_the_cpu(tmp_path):
    lora = FP32 + cpu_initial_weights(tmp_path / "init") + ["--model.converters", "lora", "--lora.rank", "4",
                                                             "--lora.alpha", "8"]
    assert_close(losses(tmp_path / "gpu", lora), losses(tmp_path / "cpu", lora, env=CPU_ENV), rel=1e-3)


def test_qlora_on_cuda_matches_the_cpu(tmp_path):
    import typing

    from titan_lite.config.schema import Lora

    if "nf4" not in typing.get_args(typing.get_type_hints(Lora)["base_dtype"]):
        pytest.skip("QLoRA ('lora.base_dtype = \"nf4\"') is not in this checkout")
    qlora = FP32 + cpu_initial_weights(tmp_path / "init") + ["--model.converters", "lora", "--lora.rank", "4",
                                                              "--lora.alpha", "8", "--lora.base_dtype", "nf4"]
    assert_close(losses(tmp_path / "gpu", qlora), losses(tmp_path / "cpu", qlora, env=CPU_ENV), rel=5e-3)


def test_float8_tracks_bf16(tmp_path):
    from titan_lite.transforms import registered_transforms

    if "quantize.linear.float8" not in registered_transforms():
        pytest.skip("the 'quantize.linear.float8' transform is not in this checkout")
    if not ON_CPU and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"float8 matmuls need compute capability 8.9+, this GPU has {torch.cuda.get_device_capability()}")
    # debugmodel: every linear's dimensions are multiples of 16, so float8 serves them all
    shape = ["--model.flavor", "debugmodel"]
    float8 = losses(tmp_path / "float8", BF16 + shape + ["--model.converters", "quantize.linear.float8"])
    assert_close(float8, losses(tmp_path / "bf16", BF16 + shape), rel=5e-2)


def prune_masks(hf: Path, out: Path, method: str, env: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "prune.py"), "--hf_assets_path", str(hf),
                           "--output_dir", str(out), "--method", method, "--nsamples", "8", "--seq_len", "64",
                           "--dtype", "float32"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env, "PYTHONPATH": os.pathsep.join(
                              p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    weights = {}
    for f in sorted(out.glob("*.safetensors")):
        weights |= load_file(f)
    return {n: w == 0 for n, w in weights.items() if "layers" in n and "norm" not in n}


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_pruning_masks_on_cuda_equal_the_cpus(tmp_path, method):
    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=0)
    hf = tmp_path / "hf"
    write_hf_folder(dict(model.named_parameters()), args, str(hf), torch.float32, str(REPO / "assets/tokenizer"))
    gpu = prune_masks(hf, tmp_path / "gpu", method, GPU_ENV)
    cpu = prune_masks(hf, tmp_path / "cpu", method, CPU_ENV)
    assert gpu.keys() == cpu.keys() and len(gpu) == 4 * 7
    if method == "wanda":  # a mask from activation norms times |W|: equal unless two scores tie within rounding
        assert all(torch.equal(gpu[n], cpu[n]) for n in gpu), [n for n in gpu if not torch.equal(gpu[n], cpu[n])]
    else:  # SparseGPT's sequential updates through a Cholesky inverse: rounding can move a borderline choice
        differing = sum(int((gpu[n] != cpu[n]).sum()) for n in gpu) / sum(m.numel() for m in gpu.values())
        assert differing <= 1e-3, f"{differing:.2%} of the mask differs"
    assert all(int(gpu[n].sum()) == gpu[n].numel() // 2 for n in gpu)


# ------------------------------------------------------------------------------------------ inference


def test_hf_export_from_cuda_matches_transformers_on_cuda(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=1)
    model = model.to(DEVICE).eval()
    export_hf([model], args, str(tmp_path / "hf"), torch.float32, str(REPO / "assets/tokenizer"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").to(DEVICE).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(reference(tokens).logits, model(tokens), atol=1e-4, rtol=0)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == args.n_layers


def test_kv_cache_generation_on_cuda_equals_full_forwards():
    from titan_lite.generate import GenerationConfig, generate

    args = flavor_args("tiny")
    args.max_seq_len = 32
    model = Llama(args)
    model.init_weights(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3)  # distinct greedy continuations, not one repeated token
    model = model.to(DEVICE).eval()
    prompts = [[5, 17, 99, 3], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    got = generate(model, prompts, GenerationConfig(max_new_tokens=10), DEVICE)
    want = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(10):
                seq.append(int(model(torch.tensor([seq], device=DEVICE))[0, -1].argmax()))
            want.append(seq[len(prompt):])
    assert got == want and len({tuple(g) for g in got}) == len(prompts)


def test_flex_block_mask_on_cuda_equals_sdpa_and_one_at_a_time():
    """attn_type flex on CUDA (FlexAttention's compiled block mask) against SDPA's additive mask on the same packed
    batch, and both against the documents run one at a time: loss and gradients. The CPU suite checks SDPA's mask
    (tests/test_packed_parity.py); this is the only check of the FlexAttention path."""
    from titan_lite.data.datasets import document_positions
    from titan_lite.loss import cross_entropy_sum

    lengths = [[40, 70, 18], [128], [5, 100, 23]]
    documents = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    tokens = torch.randint(0, 2048, documents.shape, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 2048, documents.shape, generator=torch.Generator().manual_seed(4))
    labels[:, :-1][documents[:, 1:] != documents[:, :-1]] = -100  # no label across a document boundary
    results = {}
    for attn_type in ("flex", "sdpa"):
        args = flavor_args("tiny")
        args.max_seq_len, args.attn_type, args.attn_mask_type = 128, attn_type, "block_causal"
        model = Llama(args)
        model.init_weights(seed=0)
        model = model.to(DEVICE)
        docs = documents.to(DEVICE)
        loss = cross_entropy_sum(model(tokens.to(DEVICE), positions=document_positions(docs), documents=docs),
                                 labels.to(DEVICE))
        loss.backward()
        results[attn_type] = (loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()})
    one = 0.0
    for row, doc_lengths in enumerate(lengths):
        start = 0
        for n in doc_lengths:
            piece = slice(start, start + n)
            one += cross_entropy_sum(model(tokens[row:row + 1, piece].to(DEVICE)),
                                     labels[row:row + 1, piece].to(DEVICE)).item()
            start += n
    assert abs(results["flex"][0] - results["sdpa"][0]) <= 1e-3 * abs(results["sdpa"][0])
    assert abs(results["sdpa"][0] - one) <= 1e-3 * abs(one)
    for name, grad in results["flex"][1].items():
        torch.testing.assert_close(grad, results["sdpa"][1][name], rtol=1e-3, atol=1e-5)
