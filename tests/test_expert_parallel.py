"""Expert parallelism: the degrees and their one-line errors, the expert mesh, torchtitan's EP keys (inert while EP is
off, refused when on), the all-to-all exchange against one process's experts (2 gloo processes: outputs, input and
weight gradients, experts without rows), and DRY_RUN's plan of an EP job (the experts' share, the worst-case rows)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import gloo_results
from titan_lite.config import parse_args
from titan_lite.config.validate import validate
from titan_lite.errors import ConfigError
from titan_lite.models.flavors import flavor_args
from titan_lite.parallel import memory_estimate as me
from titan_lite.parallel.expert_parallel import check_ep_divisibility, counts_within
from titan_lite.parallel.parallel_dims import ParallelDims

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ degrees and config


@pytest.mark.parametrize("dims, message", [
    (dict(dp_shard=2, cp=1, tp=1, ep=4, world_size=2),
     "'parallelism.expert_parallel_degree' = 4 must divide the ranks it is carved from, dp_shard 2 x cp 1 x tp 1 = 2, "
     "and be a multiple of cp x tp = 1"),
    (dict(dp_shard=1, cp=2, tp=2, ep=2, world_size=4),
     "'parallelism.expert_parallel_degree' = 2 must divide the ranks it is carved from, dp_shard 1 x cp 2 x tp 2 = 4, "
     "and be a multiple of cp x tp = 4"),
], ids=["more EP ranks than data ranks", "EP must span CP and TP"])
def test_degrees_that_do_not_carve_are_one_line(dims, message):
    with pytest.raises(ConfigError) as exc:
        ParallelDims(dp_replicate=1, pp=1, **dims)
    assert str(exc.value) == message


def test_without_ep_any_layout_carves_nothing():
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=2, pp=1, world_size=4)
    assert not dims.ep_enabled and "experts" not in dims.describe()


def test_efsdp_is_what_ep_leaves_of_the_data_ranks():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=1, world_size=16, ep=4)
    assert (dims.dp_shard, dims.efsdp) == (4, 2)
    assert dims.describe().endswith("tp 2 x pp 1 (experts: ep 4 x efsdp 2)")


def test_experts_must_divide_and_exist():
    check_ep_divisibility(flavor_args("tiny_moe"), 8)
    with pytest.raises(ConfigError, match=r"^'parallelism.expert_parallel_degree' = 3 must divide the model's "
                                          r"n_experts \(8\): every EP rank holds the same number of experts$"):
        check_ep_divisibility(flavor_args("tiny_moe"), 3)
    with pytest.raises(ConfigError, match=r"needs a mixture-of-experts model, but this model has no MoE layer"):
        check_ep_divisibility(flavor_args("tiny"), 2)


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.expert_tensor_parallel_degree", "2"],
     "'parallelism.expert_tensor_parallel_degree' = 2 is not supported: expert tensor parallelism is not implemented"),
    (["--parallelism.expert_parallel_degree", "2", "--parallelism.expert_parallel_comm_backend", "deepep"],
     "'parallelism.expert_parallel_comm_backend' = 'deepep' is not supported: titan_lite exchanges tokens with "
     "torch.distributed's all-to-all ('standard')"),
    (["--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_expert_parallel_overlap"],
     "'parallelism.pipeline_parallel_expert_parallel_overlap' = true needs torchtitan's DualPipeV schedule"),
    (["--parallelism.expert_parallel_degree", "0"], "'parallelism.expert_parallel_degree' must be at least 1, got 0"),
])
def test_torchtitan_ep_keys_titan_lite_lacks_are_refused_when_on(argv, message):
    with pytest.raises(ConfigError) as exc:
        validate(parse_args(argv), files=False)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_torchtitan_ep_keys_are_inert_while_ep_is_off():
    validate(parse_args(["--parallelism.expert_parallel_comm_backend", "deepep",
                         "--parallelism.pipeline_parallel_expert_parallel_overlap"]), files=False)


def test_expert_mesh_groups(monkeypatch):
    """In a fake world of 8 (HSDP 2 x 4, TP 1; and FSDP 2 x TP 2 x 2 replicas): EP groups are the inner data ranks (with
    the TP ranks), efsdp the outer ones, and the experts' FSDP mesh adds dp_replicate."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def meshes(rank: int, **degrees) -> dict[str, list]:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            dims = ParallelDims(pp=1, world_size=8, **degrees)
            dims.build_mesh("cpu")
            return {"ep": dims.submesh("ep").mesh.tolist(), "efsdp": dims.submesh("efsdp").mesh.tolist(),
                    "experts_dp": dims.expert_data_parallel_mesh.mesh.tolist()}
        finally:
            dist.destroy_process_group()

    assert meshes(5, dp_replicate=2, dp_shard=4, cp=1, tp=1, ep=2) == {
        "ep": [4, 5], "efsdp": [5, 7], "experts_dp": [[1, 3], [5, 7]]}
    assert meshes(5, dp_replicate=2, dp_shard=2, cp=1, tp=2, ep=2) == {
        "ep": [4, 5], "efsdp": [5, 7], "experts_dp": [[1, 3], [5, 7]]}


def test_a_tp_rank_takes_the_counts_of_its_rows():
    counts = torch.tensor([3, 0, 2, 1])
    assert counts_within(counts, 0, 3).tolist() == [3, 0, 0, 0]
    assert counts_within(counts, 3, 6).tolist() == [0, 0, 2, 1]
    assert counts_within(torch.tensor([2, 2, 2]), 1, 4).tolist() == [1, 2, 0]


# ------------------------------------------------------------------------------------------ the exchange, 2 gloo ranks

DIM, HIDDEN = 8, 6
# (experts, rows per expert on rank 0, on rank 1): rank 1 sends nothing to rank 0's experts in the first case
EXCHANGE_CASES = {"two local experts": (4, [3, 0, 2, 1], [0, 0, 4, 0]), "one local expert": (2, [2, 3], [0, 1])}


def _exchange_errors(rank: int, mesh, experts: int, counts: list[list[int]], grad_scale: float) -> dict:
    from titan_lite.models.parts.experts import GroupedExperts
    from titan_lite.parallel.expert_parallel import ExpertParallel

    gen = torch.Generator().manual_seed(experts)
    full = GroupedExperts(DIM, HIDDEN, experts)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    xs = [torch.randn(sum(c), DIM, generator=gen, requires_grad=True) for c in counts]
    cotangents = [torch.randn(sum(c), DIM, generator=gen) for c in counts]
    references = [full(x, torch.tensor(c)) for x, c in zip(xs, counts, strict=True)]
    sum((y * w).sum() for y, w in zip(references, cotangents, strict=True)).backward()

    sharded = GroupedExperts(DIM, HIDDEN, experts)
    sharded.load_state_dict(full.state_dict())
    ExpertParallel(mesh, grad_scale=grad_scale).apply(sharded)
    x = xs[rank].detach().clone().requires_grad_()
    y = sharded(x, torch.tensor(counts[rank]))
    (y * cotangents[rank]).sum().backward()
    local = slice(rank * experts // 2, (rank + 1) * experts // 2)
    errors = {"out": (y - references[rank]).abs().max().item(), "grad_x": (x.grad - xs[rank].grad).abs().max().item()}
    for name, p in sharded.named_parameters():
        assert p.placements[0].is_shard(0)
        reference = getattr(full, name).grad[local] * grad_scale
        errors[f"grad_{name}"] = (p.grad.to_local() - reference).abs().max().item()
    return errors


def _exchange_results(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    return {f"{name}, grad_scale {scale}": _exchange_errors(rank, mesh, experts, [c0, c1], scale)
            for name, (experts, c0, c1) in EXCHANGE_CASES.items() for scale in (1.0, 0.5)}


@pytest.fixture(scope="module")
def exchange_errors(tmp_path_factory) -> list[dict]:
    return gloo_results(_exchange_results, 2, tmp_path_factory.mktemp("ep"))


@pytest.mark.parametrize("case", [f"{name}, grad_scale {s}" for name in EXCHANGE_CASES for s in (1.0, 0.5)])
def test_exchange_equals_one_process(exchange_errors, case):
    """Each rank's rows through the experts of both ranks equal one process's experts; the input gradient is exact
    and the experts' gradients are the one process's times grad_scale (the data-parallel correction)."""
    for rank, table in enumerate(exchange_errors):
        errors = table[case]
        assert set(errors) == {"out", "grad_x", "grad_w1", "grad_w2", "grad_w3"}
        for name, error in errors.items():
            assert error <= 1e-5, f"rank {rank} {name}: {error}"


# ------------------------------------------------------------------------------------------ DRY_RUN


def test_routed_rows_are_planned_at_the_worst_case():
    args = flavor_args("qwen3_30B_A3B")  # 128 experts, top 8
    one_rank = me.ActivationShape(tokens=4096, compute_bytes=2)
    assert me.routed_rows(args, one_rank) == (4096 * 8, 4096 * 8)
    ep8 = me.ActivationShape(tokens=4096, compute_bytes=2, ep=8)
    assert me.routed_rows(args, ep8) == (4096 * 8, 8 * 4096 * 8)  # 16 local experts: all 8 choices can land here
    ep64_tp2 = me.ActivationShape(tokens=4096, compute_bytes=2, tp=2, ep=64)
    assert me.routed_rows(args, ep64_tp2) == (2048 * 8, 64 * 2048 * 2)  # 2 local experts: at most 2 choices each
    assert me.all_to_all_buffer_bytes(args, ep8) == (4096 * 8 + 2 * 8 * 4096 * 8) * 2048 * 2


def test_dry_run_plans_qwen3_30b_a3b_with_ep_8_on_32_ranks():
    env = {**os.environ, "DRY_RUN": "1", "NGPU": "8", "NNODES": "4", "OMP_NUM_THREADS": "1",
           "CONFIG_FILE": str(REPO / "tests" / "integration" / "base.toml")}
    cmd = [str(REPO / "run_train.sh"), "--model.flavor", "qwen3_30B_A3B", "--parallelism.expert_parallel_degree", "8",
           "--training.seq_len", "4096", "--training.local_batch_size", "1", "--activation_checkpoint.mode", "full",
           "--training.mixed_precision_param", "bfloat16"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "world 32 = dp_replicate 1 x dp_shard 32 x cp 1 x tp 1 x pp 1 (experts: ep 8 x efsdp 4)" in out
    assert ("experts: 48 MoE layers, 16 of 128 on each rank (ep 8), sharded over efsdp 4; each rank sends 32,768 "
            "routed rows per layer and microbatch; its experts compute 32,768 when balanced and are planned at the "
            "worst case, 262,144 (every token of the 8 EP ranks choosing 8 of this rank's 16 experts)") in out
    # every tensor's sharded dimension divides: the dense part over 32 FSDP ranks, the experts over ep 8 x efsdp 4
    assert re.findall(r"local parameters: ([\d,]+)", out) == [f"{30_532_122_624 // 32:,}"]
    assert ("MoE: 262,144 routed rows per layer (worst case of expert parallelism), EP all-to-all 32,768 rows out "
            "and up to 262,144 in, 2.12 GiB with their regrouping (within a block's working set)") in out


@pytest.mark.slow
def test_ep_plan_is_within_ten_percent_of_the_worst_case_peak():
    """debugmodel_moe on 2 ranks, every token routed to rank 1's experts (zeroed router logits): the planned worst
    case, measured (benchmarks/memory_plan.py's ep2 case)."""
    sys.path.insert(0, str(REPO))
    from benchmarks.memory_plan import SHAPES, job_of
    from benchmarks.training_run import estimate_bytes, measure

    job = job_of("ep2", SHAPES["debugmodel_moe"])
    assert job.worst_case_routing
    estimate, result = estimate_bytes(job), measure(job, timeout=300)
    assert "error" not in result, result
    low, high = sorted(result["rank_peaks"])
    assert high > 1.3 * low  # the routing is as lopsided as planned: one rank computes every row
    assert abs(estimate / result["peak_bytes"] - 1) <= 0.10, (estimate, result["peak_bytes"])
