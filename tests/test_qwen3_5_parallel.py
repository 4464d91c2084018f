"""Qwen3.5's Gated DeltaNet under tensor parallelism on 2 gloo ranks (tiny_qwen3_5): each parameter's placement and
local shape (the split by key-head groups), and the loss and every DeltaNet gradient equal to one process's; under
context parallel (2 ranks, head-tail and contiguous, with and without packed documents) the mixer's outputs and
gradients equal one process's. The run_train.sh parity of every layout is tests/integration/test_qwen3_5_parallel.py."""

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import gloo_results, spawn_gloo
from tests.test_parallelize import _reference, _run_scenario
from titan_lite.errors import ConfigError
from titan_lite.models.flavors import flavor_args
from titan_lite.parallel.tensor_parallel import check_tp_divisibility

FLAVOR = "tiny_qwen3_5"  # dim 64; DeltaNet: 2 key heads of 16, 4 value heads of 16 (conv_dim 128); attention layer 3
DELTANET = "layers.0.attention."
# name: (placement, local shape on each of 2 TP ranks)
PLACEMENTS = {
    DELTANET + "in_proj_qkv.weight": ("Shard(dim=0)", [64, 64]),
    DELTANET + "conv1d.weight": ("Replicate()", [128, 1, 4]),
    DELTANET + "in_proj_z.weight": ("Shard(dim=0)", [32, 64]),
    DELTANET + "in_proj_b.weight": ("Shard(dim=0)", [2, 64]),
    DELTANET + "in_proj_a.weight": ("Shard(dim=0)", [2, 64]),
    DELTANET + "A_log": ("Shard(dim=0)", [2]),
    DELTANET + "dt_bias": ("Shard(dim=0)", [2]),
    DELTANET + "norm.weight": ("Replicate()", [16]),
    DELTANET + "out_proj.weight": ("Shard(dim=1)", [64, 32]),
    "layers.1.feed_forward.w1.weight": ("Shard(dim=0)", [96, 64]),
    "layers.3.attention.wq.weight": ("Shard(dim=0)", [128, 64]),  # [query | gate] blocks of each head
    "layers.3.attention.q_norm.weight": ("Replicate()", [32]),
}
SCENARIOS = {
    "tp2": dict(tp=2, tied=None, loss_parallel=True, flavor=FLAVOR, watched=list(PLACEMENTS)),
    "tp2_no_loss_parallel": dict(tp=2, tied=None, loss_parallel=False, flavor=FLAVOR, watched=list(PLACEMENTS)),
}


def _worker(rank: int, out_dir: str) -> None:
    for name, spec in SCENARIOS.items():
        Path(out_dir, f"{name}.rank{rank}.json").write_text(json.dumps(_run_scenario(name, **spec)))
    dist.barrier()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("qwen3_5_tp")
    spawn_gloo(_worker, 2, str(out))
    return {(name, rank): json.loads(Path(out, f"{name}.rank{rank}.json").read_text())
            for name in SCENARIOS for rank in range(2)}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_deltanet_is_split_by_key_head_groups(reports, rank):
    got = reports[("tp2", rank)]["params"]
    assert {name: (info["placements"], info["local_shape"]) for name, info in got.items()} == {
        name: ([placement], shape) for name, (placement, shape) in PLACEMENTS.items()}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_loss_and_deltanet_grads_equal_one_process(reports, scenario):
    import torch

    ref_loss, ref_grads = _reference(None, FLAVOR)
    for rank in range(2):
        report = reports[(scenario, rank)]
        assert abs(report["loss"] - ref_loss) < 1e-5, (scenario, rank, report["loss"], ref_loss)
        for name, info in report["params"].items():
            torch.testing.assert_close(torch.tensor(info["grad"]), ref_grads[name], atol=1e-5, rtol=1e-4,
                                       msg=f"{scenario} {name}")


def test_tp_must_divide_the_linear_key_heads():
    with pytest.raises(ConfigError, match=r"^'parallelism.tensor_parallel_degree' = 4 must divide the model's "
                                          r"n_kv_heads \(2\)"):
        check_tp_divisibility(flavor_args(FLAVOR), 4)
    args = flavor_args(FLAVOR)
    args.n_kv_heads, args.n_heads = 4, 4
    with pytest.raises(ConfigError, match=r"must divide the model's linear_num_key_heads \(2\)$"):
        check_tp_divisibility(args, 4)


# Packed documents of 13, 29 and 22 tokens in one row, 40 and 24 in the other: starts inside and on chunk boundaries
DOCUMENTS = [[0] * 13 + [1] * 29 + [2] * 22, [0] * 40 + [1] * 24]


def _cp_worker(rank: int) -> dict:
    """The mixer (wide weights: states far from zero) on 2 x 64 tokens alone, then on this rank's CP share: the
    largest differences of its outputs and gradients, relative to the largest reference value."""
    import torch

    from titan_lite.models.parts.gated_deltanet import GatedDeltaNet
    from titan_lite.parallel.context_parallel import ContextParallelScan, shard_positions

    torch.manual_seed(0)
    mixer = GatedDeltaNet(flavor_args(FLAVOR), 0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    x, documents = torch.randn(2, 64, mixer.out_proj.out_features), torch.tensor(DOCUMENTS)
    report = {}

    def run(inputs, mask):
        mixer.zero_grad()
        inputs = inputs.clone().requires_grad_()
        out = mixer(inputs, mask=mask)
        out.square().sum().backward()
        return out.detach(), inputs.grad, {n: p.grad.clone() for n, p in mixer.named_parameters()}

    for balancer in ("headtail", None):
        for packed in (False, True):
            mixer.split = None
            ref_out, ref_dx, ref_grads = run(x, mixer.document_mask(documents, x.dtype, compiled=True)
                                             if packed else None)
            mixer.split = ContextParallelScan(dist.group.WORLD, balancer)
            mine = shard_positions(64, rank, 2, balancer)
            out, dx, grads = run(x[:, mine], mixer.document_mask(documents, x.dtype) if packed else None)
            for g in grads.values():
                dist.all_reduce(g)

            def relative(a, b):
                return ((a - b).abs().max() / b.abs().max()).item()
            report[f"{balancer}_{'packed' if packed else 'rows'}"] = {
                "out": relative(out, ref_out[:, mine]), "input_grad": relative(dx, ref_dx[:, mine]),
                "param_grads": max(relative(grads[n], ref_grads[n]) for n in grads)}
    dist.barrier()
    return report


def test_context_parallel_deltanet_equals_one_process(tmp_path):
    """Each rank's chunks start from the conv window and state the chunks before them leave (exchanged and composed:
    the rule is affine in its state); without that pass the outputs differ by far more than 1e-5."""
    for rank, report in enumerate(gloo_results(_cp_worker, 2, tmp_path)):
        assert len(report) == 4
        for case, diffs in report.items():
            assert max(diffs.values()) < 1e-5, (rank, case, diffs)


def test_context_parallel_chunks_shorter_than_the_conv_window_are_refused():
    import torch

    from titan_lite.models.parts.gated_deltanet import GatedDeltaNet, SplitSequence

    mixer = GatedDeltaNet(flavor_args(FLAVOR), 0)
    mixer.split = SplitSequence()
    mixer.split.pieces = 2  # head-tail: 2 chunks of 2 tokens on this rank, the conv reaches 3 back
    with pytest.raises(ConfigError, match=r"^context parallel cuts each sequence into chunks of 2 tokens, fewer than "
                                          r"the Gated DeltaNet's conv window of linear_conv_kernel_dim - 1 = 3; "):
        mixer(torch.zeros(1, 4, 64))


def test_tp_must_divide_the_moe_shared_expert_width():
    args = flavor_args("debugmodel_qwen3_5_moe")
    args.moe_shared_ffn_dim = 255  # every other width divides 2
    with pytest.raises(ConfigError, match=r"= 2 must divide the model's moe_shared_ffn_dim \(255\)$"):
        check_tp_divisibility(args, 2)
