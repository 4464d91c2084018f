"""Integration parity of FSDP, HSDP, replication, TP, AC, compile, accumulation and two-node launches vs one process.

Every run uses base.toml plus overrides and sees the same global batch of 8 sequences per step. The data loader
splits documents round-robin over data-parallel ranks, so the test corpus has documents of exactly seq_len + 1
tokens: each document is one sequence, and any split (1x8, 2x4, 4x2, with or without accumulation) covers the
same 8 sequences per step.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.integration.harness import BASE_TOML, REPO, Run, assert_losses_close, one_window_dataset, run_train

SEQ_LEN = 64
GLOBAL_BATCH = 8
STEPS = 5
DOCS_NEEDED = GLOBAL_BATCH * STEPS + GLOBAL_BATCH
ATOL = 1e-5


@pytest.fixture(scope="module")
def data_overrides(tmp_path_factory) -> list[str]:
    return [*one_window_dataset(tmp_path_factory.mktemp("data"), DOCS_NEEDED, SEQ_LEN), "--training.steps", str(STEPS)]


@pytest.fixture(scope="module")
def reference(data_overrides, tmp_path_factory) -> dict[int, float]:
    """One process, one micro-batch of 8 sequences per step."""
    run = run_train([*data_overrides, "--training.local_batch_size", "8"], tmp_path_factory.mktemp("reference"), ngpu=1)
    losses = run.tb_losses()
    assert run.returncode == 0 and sorted(losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert all(5.0 < v < 9.0 for v in losses.values()), losses  # a sane tiny-model loss, not zeros or NaNs
    return losses


@pytest.fixture(scope="module")
def fsdp2_run(data_overrides, tmp_path_factory) -> Run:
    """Single node, 2 processes, FSDP over both (shared by the FSDP parity and the two-node tests)."""
    return run_train([*data_overrides, "--training.local_batch_size", "4"], tmp_path_factory.mktemp("fsdp2"), ngpu=2)


def test_fsdp(fsdp2_run, reference):
    assert "dp_shard 2" in fsdp2_run.output
    assert_losses_close(fsdp2_run, reference, ATOL)


# (id, processes, local batch, overrides): all with a global batch of 8 per step.
CASES = [
    ("hsdp_replicate2_shard2", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("ddp_replicate2", 2, 4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("tp2_loss_parallel", 2, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    ("tp2_no_loss_parallel_ac_selective_op", 2, 8,
     ["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel",
      "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    ("fsdp2_tp2", 4, 4, ["--parallelism.tensor_parallel_degree", "2"]),
    ("fsdp2_ac_full_accumulation2", 2, 2, ["--activation_checkpoint.mode", "full",
                                           "--training.global_batch_size", "8"]),
    ("fsdp2_compile", 2, 4, ["--compile.enable"]),
    ("fsdp2_cpu_offload_no_reshard", 2, 4, ["--training.enable_cpu_offload",
                                            "--parallelism.fsdp_reshard_after_forward", "never"]),
    ("accumulation_4x2_one_process", 1, 2, ["--training.global_batch_size", "8"]),
]

# What the trainer's start-up line must say for each case, so a silently ignored override cannot pass.
EXPECTED_LAYOUT = {
    "hsdp_replicate2_shard2": "dp_replicate 2 x dp_shard 2 x cp 1 x tp 1",
    "ddp_replicate2": "dp_replicate 2 x dp_shard 1 x cp 1 x tp 1",
    "tp2_loss_parallel": "dp_replicate 1 x dp_shard 1 x cp 1 x tp 2",
    "tp2_no_loss_parallel_ac_selective_op": "dp_replicate 1 x dp_shard 1 x cp 1 x tp 2",
    "fsdp2_tp2": "dp_replicate 1 x dp_shard 2 x cp 1 x tp 2",
    "fsdp2_ac_full_accumulation2": "dp_shard 2 x cp 1 x tp 1 x pp 1; gradient accumulation 2",
    "fsdp2_compile": "dp_shard 2",
    "fsdp2_cpu_offload_no_reshard": "dp_shard 2",
    "accumulation_4x2_one_process": "gradient accumulation 4",
}


@pytest.mark.parametrize("name, ngpu, local_batch, overrides", CASES, ids=[c[0] for c in CASES])
def test_parity_with_one_process(name, ngpu, local_batch, overrides, data_overrides, reference, tmp_path):
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"} if "--compile.enable" in overrides else None
    run = run_train([*data_overrides, "--training.local_batch_size", str(local_batch), *overrides], tmp_path,
                    ngpu=ngpu, env=env)
    assert EXPECTED_LAYOUT[name] in run.output, run.output[-3000:]
    assert_losses_close(run, reference, ATOL)


# ------------------------------------------------------------------------- two nodes on one machine


def start_node(node_rank: int, port: int, overrides: list[str], dump_folder: Path) -> subprocess.Popen:
    """NNODES=2 NODE_RANK=node_rank NGPU=1 ./run_train.sh, as one would type it on each of two machines."""
    env = {**os.environ, "CONFIG_FILE": str(BASE_TOML), "NGPU": "1", "NNODES": "2", "NODE_RANK": str(node_rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    env.pop("DRY_RUN", None)
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(dump_folder), *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_match_one_node(data_overrides, fsdp2_run, tmp_path):
    overrides = [*data_overrides, "--training.local_batch_size", "4"]
    port = free_port()
    nodes = [start_node(rank, port, overrides, tmp_path / f"node{rank}") for rank in (0, 1)]
    outputs = []
    for node in nodes:
        out, _ = node.communicate(timeout=600)
        outputs.append(out)
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert "world 2 = dp_replicate 1 x dp_shard 2" in outputs[0], outputs[0][-3000:]
    two_nodes = Run(0, outputs[0], tmp_path / "node0")
    assert_losses_close(two_nodes, fsdp2_run.tb_losses(), 1e-6)


def test_tied_embeddings_fsdp2_matches_one_process(tmp_path):
    """A tied model (like Llama 3.2 1B) trains one shared embedding/head matrix in one process and under FSDP alike."""
    from tests.helpers import tied_tiny_assets

    common = ["--model.flavor", "hf", "--model.hf_assets_path", tied_tiny_assets(tmp_path / "assets"),
              "--training.seq_len", "32", "--training.steps", "3", "--metrics.log_freq", "1",
              "--validation.enable=false"]
    one = run_train([*common, "--training.local_batch_size", "8"], tmp_path / "one", ngpu=1)
    two = run_train([*common, "--training.local_batch_size", "4"], tmp_path / "two", ngpu=2)
    assert one.returncode == 0 and two.returncode == 0, (one.output + two.output)[-3000:]
    assert "parameters (328,256 held by rank 0)" in one.output, one.output[-2000:]  # the shared matrix once
    held = int(re.search(r"parameters \(([\d,]+) held by rank 0\)", two.output).group(1).replace(",", ""))
    assert 328_256 // 2 <= held < 328_256, two.output[-2000:]  # FSDP 2: rank 0 holds its half (rounded up per shard)
    reference = one.tb_losses()
    assert sorted(reference) == [1, 2, 3]
    assert_losses_close(two, reference, ATOL)
