"""QLoRA's NF4 base in-process: shards quantize as the whole tensor (with torchao's format), FSDP2 gathers the 4-bit
codes, the plan hooks' figures for the shipped configs, and the refusals."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.helpers import spawn_gloo
from titan_lite.config import parse_args
from titan_lite.errors import ConfigError
from titan_lite.job.plan import plan_job
from titan_lite.transforms.nf4 import dequantize, nf4_bytes_per_element, quantize_param
from titan_lite.transforms.nf4.fsdp import fsdp_records, swap_parameter
from titan_lite.transforms.nf4.quantize import quantize_local

GIB = 1024**3


def weight(rows: int = 256, cols: int = 256) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(7)) * 0.05


def test_nf4_has_torchao_format_and_error():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    w = weight()
    ours, theirs = quantize_local(w, [], w.numel()), to_nf4(w, 64, 256)
    assert torch.equal(ours.quantized_data, theirs.quantized_data)  # the same 4-bit codes
    assert ours.quantized_scalers.dtype == torch.int8 and ours.quantized_data.dtype == torch.uint8
    torch.testing.assert_close(dequantize(ours), dequantize(theirs), atol=1e-6, rtol=0)
    relative = (dequantize(ours) - w).norm() / w.norm()
    assert 0.05 < relative < 0.12  # NF4's error on a normal matrix (about 0.09)
    assert nf4_bytes_per_element(w.numel(), 4) == 0.5 + 1 / 64 + 4 / (64 * 256)


def _fsdp_worker(rank: int) -> None:
    w, x = weight(), torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    model = nn.Sequential(nn.Linear(256, 256, bias=False))
    model[0].weight.data.copy_(w)
    model[0].weight.requires_grad_(False)
    fully_shard(model[0], mesh=init_device_mesh("cpu", (2,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    records = fsdp_records([model])
    swap_parameter(model[0], "weight", quantize_param(model[0].weight), records)
    out = model(x)
    # the rank's half quantized with the whole tensor's scale mean: the gathered weight is the whole tensor's NF4
    whole = dequantize(quantize_local(w, [], w.numel()))
    torch.testing.assert_close(out, F.linear(x, whole), atol=1e-6, rtol=0)
    gathered = [t for r in records.values() for t in r.all_gather_outputs]
    assert {t.dtype for t in gathered} == {torch.uint8, torch.int8, torch.float32}
    # codes (4 bits), block scales (int8), 4 fp32 factors: a 16th of the fp32 weight, no dense copy
    assert sum(t.numel() * t.element_size() for t in gathered) == 256 * 256 // 2 + 256 * 256 // 64 + 4 * 4


@pytest.mark.slow  # two spawned processes: about 25 s on the shared 2-core machine
def test_fsdp_gathers_4_bit_codes_of_shards_quantized_as_the_whole_tensor():
    spawn_gloo(_fsdp_worker, 2)


CPU = ["--model.converters", "lora", "--lora.rank", "4", "--lora.base_dtype", "nf4", "--training.seq_len", "32"]


@pytest.mark.parametrize("overrides, world, message", [
    (["--model.flavor", "debugmodel", "--parallelism.tensor_parallel_degree", "2"], 2,
     "'lora.base_dtype' = 'nf4' does not support tensor parallelism: torchao's NF4 tensor has no DTensor matmul"),
    (["--model.flavor", "debugmodel_gqa"], 2,
     "'lora.base_dtype' = 'nf4': layers.0.attention.wk.weight's shard of 32 x 256 = 8,192 elements is not a "
     "multiple of 16,384"),
    # tiny's 32 x 64 k projection: 32 blocks, one group of 32 scales (256 does not divide them): whole in one process
    (["--model.flavor", "tiny"], 2,
     "layers.0.attention.wk.weight's shard of 16 x 64 = 1,024 elements is not a multiple of 2,048"),
])
def test_refusals_are_one_line(overrides, world, message):
    with pytest.raises(ConfigError) as info:
        plan_job(parse_args([*CPU, *overrides]), world)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_dry_run_plans_the_shipped_configs(capsys, monkeypatch):
    """The 8B config on one 24 GiB GPU and the 70B one on two: NF4 storage from the shapes, adapters in float32."""
    from titan_lite.dry_run import dry_run

    for config, ngpu in (("llama3_8b_qlora.toml", "1"), ("llama3_70b_qlora.toml", "2")):
        monkeypatch.setenv("NGPU", ngpu)
        cfg = parse_args(["--job.config_file", f"train_configs/{config}", "--model.hf_assets_path",
                          "./assets/tokenizer", "--dry_run.device_memory_gib", "24"])
        assert dry_run(cfg) == 5  # only the data and the weights are missing
        out = capsys.readouterr().out
        assert "dry run OK" in out and re.search(r"lora: NF4 base \(QLoRA\): \d+ frozen block linears", out)
        peak = float(re.search(r"largest peak ([\d.]+) GiB", out)[1])
        assert 5 < peak < (12 if ngpu == "1" else 24), out  # 8B: torchtune's settings, its 7.4 GiB in reach
        if ngpu == "1":  # 8B: NF4 block linears (bf16 factors) + bf16 embeddings, head, norms + fp32 adapters
            block, other, adapters = 6_979_321_856, 8_030_261_248 - 6_979_321_856, 83_886_080
            nf4 = block * nf4_bytes_per_element(4096 * 4096, 2)
            expected = (nf4 + other * 2 + 2 * adapters * 4) / GIB  # adapters and PiSSA's initial factors
            assert float(re.search(r"parameters\s+([\d.]+) GiB", out)[1]) == pytest.approx(expected, abs=0.01)
        else:
            assert "(offloaded to CPU)" in out and "2 ranks alike" in out


@pytest.mark.slow  # a worker process planning and training: about 30 s on the shared machine
def test_benchmark_worker_reports_the_nf4_base_storage_and_the_plan():
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", "--impl", "titan_lite", "--shape", "tiny",
                           "--steps", "1", "--warmup", "0", "--lora", "--lora.rank 4 --lora.base_dtype nf4",
                           "--tensor_peak", "--plan"], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": ".", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT "))
    r = json.loads(line.removeprefix("BENCH_RESULT "))
    # tiny's 64-wide projections group 64 scales: 0.5 + 1/64 + 4/4096 bytes a weight against bf16's 2
    assert r["base_bytes"] / r["base_bf16_bytes"] == pytest.approx((0.5 + 1 / 64 + 4 / 4096) / 2, rel=1e-3)
    assert r["planned_peak_bytes"] > r["peak_tensor_bytes"] > 0
