"""Context parallel: shard and RoPE positions; 2-process CP attention and model against single-process references."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import spawn_on_free_port
from titan_lite.errors import ConfigError
from titan_lite.parallel.context_parallel import GlobalRopePositions, shard_positions

CP = 2
# (load balancer, query heads, kv heads)
ATTENTION_CASES = [("headtail", 4, 4), ("headtail", 4, 2), (None, 4, 4), (None, 6, 2)]
MODEL_CASES = ["headtail", None]
# The families' options under CP (head-tail): q/k norms with head_dim 32, q/k/v biases, a window (8) that spans
# the chunk boundaries of a 32-token sequence.
FAMILY_FLAVORS = ["tiny_qwen3", "tiny_qwen2", "tiny_mistral"]
# YaRN (Qwen3's long-context RoPE) past its original context of 8: each rank's rows of the scaled cache, mscale too.
YARN = dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=8)


def test_headtail_positions_pair_head_and_tail_chunks():
    # 8 tokens, CP 2 -> 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2.
    assert shard_positions(8, 0, 2, "headtail").tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 1, 2, "headtail").tolist() == [2, 3, 4, 5]
    assert shard_positions(12, 2, 3, "headtail").tolist() == [4, 5, 6, 7]


def test_contiguous_positions_without_load_balancer():
    assert shard_positions(8, 1, 2, None).tolist() == [4, 5, 6, 7]
    assert shard_positions(9, 2, 3, "none").tolist() == [6, 7, 8]


def test_indivisible_sequence_is_a_config_error():
    with pytest.raises(ConfigError, match="10 is not divisible by the 4"):
        shard_positions(10, 0, 2, "headtail")


def test_rope_hook_hands_the_block_its_global_rows():
    rope = torch.arange(16.0)[:, None, None].expand(16, 2, 2)  # row r holds r
    x = torch.zeros(1, 4, 8)
    _, sharded = GlobalRopePositions(cp_rank=0, cp_size=2, load_balancer="headtail")(None, (x, rope))
    assert sharded[:4, 0, 0].tolist() == [0.0, 1.0, 6.0, 7.0]


def test_seq_len_check_names_the_numbers():
    from titan_lite.config.schema import JobConfig
    from titan_lite.parallel.context_parallel import check_sequence_lengths

    cfg = JobConfig()
    cfg.parallelism.context_parallel_degree, cfg.parallelism.tensor_parallel_degree = 2, 2
    cfg.training.seq_len = 36  # divisible by 2 x CP = 4, not by 2 x CP x TP = 8
    with pytest.raises(ConfigError, match=r"'training.seq_len' = 36 .* 8 \(2 x context_parallel_degree 2 x tensor"):
        check_sequence_lengths(cfg)
    cfg.training.seq_len = 40
    check_sequence_lengths(cfg)


# ------------------------------------------------------------------------------- 2 gloo processes


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _attention_errors(rank: int, group, load_balancer, n_heads: int, n_kv: int) -> dict:
    """Max |CP - reference| of the output and of the q/k/v gradients on this rank's shard."""
    from titan_lite.parallel.context_parallel import ContextParallelAttention

    gen = torch.Generator().manual_seed(n_heads * 10 + n_kv)
    b, s, d = 2, 16, 8
    q, k, v = (torch.randn(b, h, s, d, generator=gen) for h in (n_heads, n_kv, n_kv))
    weight = torch.randn(b, n_heads, s, d, generator=gen)  # a random cotangent so every output entry matters
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=n_heads != n_kv)
    (reference * weight).sum().backward()

    positions = shard_positions(s, rank, CP, load_balancer)
    local = [t.index_select(2, positions).requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(group, load_balancer)(*local)
    (out * weight.index_select(2, positions)).sum().backward()
    errors = {"out": _max_diff(out, reference.index_select(2, positions))}
    for name, mine, ref in zip("qkv", local, full, strict=True):
        errors[f"grad_{name}"] = _max_diff(mine.grad, ref.grad.index_select(2, positions))
    return errors


def _model_errors(rank: int, parallel_dims, load_balancer, flavor: str = "tiny", **overrides) -> dict:
    """A tiny flavor (with `overrides` of its args) with CP vs without: logits on this rank's shard and the
    CP-summed parameter gradients."""
    from dataclasses import replace

    import torch.distributed as dist

    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args
    from titan_lite.parallel.context_parallel import apply_cp, shard_batch

    args = replace(flavor_args(flavor), max_seq_len=64, **overrides)
    reference, model = Llama(args), Llama(args)
    for m in (reference, model):
        m.init_weights(seed=3)
    cfg = SimpleNamespace(parallelism=SimpleNamespace(context_parallel_load_balancer=load_balancer))
    apply_cp(model, parallel_dims, cfg)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(7))
    full_logits = reference(tokens)
    full_logits.square().mean().backward()

    (local_tokens,) = shard_batch((tokens,), parallel_dims, load_balancer)
    local_logits = model(local_tokens)
    # The mean over the full logits, written as this rank's share of the sum: the CP ranks' gradients add up to it.
    (local_logits.square().sum() / full_logits.numel()).backward()
    positions = shard_positions(32, rank, CP, load_balancer)
    errors = {"logits": _max_diff(local_logits, full_logits.index_select(1, positions))}
    grad_error = 0.0
    for (_name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad_error = max(grad_error, _max_diff(grad, ref.grad))
    errors["param_grads"] = grad_error
    return errors


def _gathered_shard_shapes(parallel_dims) -> list[list[int]]:
    """The shapes of the shards a tiny GQA Llama under CP hands to the all-gather: one per gather, fwd and bwd."""
    from unittest import mock

    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args
    from titan_lite.parallel import context_parallel

    args = flavor_args("tiny")
    args.max_seq_len = 64
    model = Llama(args)
    model.init_weights(seed=3)
    cfg = SimpleNamespace(parallelism=SimpleNamespace(context_parallel_load_balancer="headtail"))
    context_parallel.apply_cp(model, parallel_dims, cfg)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(7))
    (local_tokens,) = context_parallel.shard_batch((tokens,), parallel_dims, "headtail")
    with mock.patch.object(context_parallel, "gather_shards", wraps=context_parallel.gather_shards) as spy:
        model(local_tokens).square().mean().backward()
    return [list(call.args[0].shape) for call in spy.call_args_list]


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from titan_lite.parallel.parallel_dims import ParallelDims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(CP))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=CP)
    try:
        parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=CP, tp=1, pp=1, world_size=CP)
        parallel_dims.build_mesh("cpu")
        group = parallel_dims.submesh("cp").get_group()
        results = {}
        for lb, heads, kv in ATTENTION_CASES:
            results[f"attention-{lb}-{heads}-{kv}"] = _attention_errors(rank, group, lb, heads, kv)
        for lb in MODEL_CASES:
            results[f"model-{lb}"] = _model_errors(rank, parallel_dims, lb)
        for flavor in FAMILY_FLAVORS:
            results[f"model-{flavor}"] = _model_errors(rank, parallel_dims, "headtail", flavor)
        results["model-tiny_qwen3_yarn"] = _model_errors(rank, parallel_dims, "headtail", "tiny_qwen3", **YARN)
        results["gathered_shapes"] = _gathered_shard_shapes(parallel_dims)
        partial = os.path.join(out_dir, f".rank{rank}.json")
        with open(partial, "w") as f:
            json.dump(results, f)
        os.replace(partial, os.path.join(out_dir, f"rank{rank}.json"))  # whole or absent
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_errors(tmp_path_factory) -> list[dict]:
    """Both ranks' result tables (errors, gathered shapes) from one spawn of 2 gloo processes."""
    out_dir = tmp_path_factory.mktemp("cp")
    os.environ["OMP_NUM_THREADS"] = "1"
    files = [out_dir / f"rank{r}.json" for r in range(CP)]
    spawn_on_free_port(_worker, CP, str(out_dir), results_complete=lambda: all(f.exists() for f in files))
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("load_balancer,n_heads,n_kv", ATTENTION_CASES)
def test_cp_attention_matches_full_causal_sdpa(cp_errors, load_balancer, n_heads, n_kv):
    for rank, table in enumerate(cp_errors):
        errors = table[f"attention-{load_balancer}-{n_heads}-{n_kv}"]
        assert set(errors) == {"out", "grad_q", "grad_k", "grad_v"}
        for name, err in errors.items():
            assert err <= 1e-5, f"rank {rank} {name}: max error {err}"


@pytest.mark.parametrize("case", [*MODEL_CASES, *FAMILY_FLAVORS, "tiny_qwen3_yarn"])
def test_cp_llama_matches_single_process(cp_errors, case):
    """The tiny Llama with either load balancer; the family flavors with head-tail; Qwen3 with YaRN."""
    for rank, table in enumerate(cp_errors):
        errors = table[f"model-{case}"]
        assert errors["logits"] <= 1e-5, f"rank {rank} logits: {errors['logits']}"
        assert errors["param_grads"] <= 1e-6, f"rank {rank} parameter gradients: {errors['param_grads']}"


def test_cp_all_gathers_kv_with_kv_heads_not_query_heads(cp_errors):
    from titan_lite.models.flavors import flavor_args

    args = flavor_args("tiny")
    assert args.kv_heads < args.n_heads  # GQA, so expanding before the gather would show
    local_kv = [2, args.kv_heads, 32 // CP, args.head_dim]  # batch 2 of 32 tokens, half on each rank
    for rank, table in enumerate(cp_errors):
        shapes = table["gathered_shapes"]
        assert len(shapes) == 2 * args.n_layers, f"rank {rank}: expected K and V of each block, got {shapes}"
        assert all(shape == local_kv for shape in shapes), f"rank {rank}: {shapes}"
