"""The decode engine on 2 gloo ranks of an FSDP-sharded model, each rank its own prompts of deliberately unequal
work (rank 0's completions end early at stop tokens, rank 1's run long and need more prefills): gathering layer by
layer in lockstep (the same number of forwards on both ranks, idle prefills and idle steps on the rank done first)
and with the weights gathered once (no collective in any decode forward, each rank on its own), each completion's
tokens equal, and its log-probabilities within 1e-5 of, what one process decodes; a watchdog fails a hang."""

import faulthandler
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.helpers import gloo_results
from tests.test_engine import STOPS, widened_model
from titan_lite.generate import GenerationConfig, Lockstep
from titan_lite.generate.engine import EngineStats, decode_slots
from titan_lite.parallel.gather_once import gathered_once

CPU = torch.device("cpu")
NEW = 12
CFG = GenerationConfig(max_new_tokens=NEW, temperature=1.0, top_k=60, stop_ids=STOPS, keep_stop=True, slots=2,
                       stop_check_interval=2)


def rank_prompts(rank: int, vocab: int) -> list[list[int]]:
    """Rank 0: one prompt x 2; rank 1: three prompts x 2, longer (more admissions, so more prefills)."""
    g = torch.Generator().manual_seed(11 + rank)
    lengths = (4,) if rank == 0 else (9, 5, 13)
    return [p for n in lengths for p in [torch.randint(40, vocab, (n,), generator=g).tolist()] * 2]


def rank_uniforms(rank: int, prompts: list[list[int]]) -> torch.Tensor:
    """Rank 0 draws its tokens from the low end of the CDF, where the stop tokens (ids 3..39) lie: it ends early."""
    u = torch.rand(len(prompts), NEW, generator=torch.Generator().manual_seed(rank))
    return u * 0.05 if rank == 0 else 0.2 + 0.8 * u


def counted_all_gathers(run):
    calls = []
    original = dist.all_gather_single if hasattr(dist, "all_gather_single") else None
    original_into = dist.all_gather_into_tensor

    def count(fn):
        def wrapped(*args, **kwargs):
            calls.append(1)
            return fn(*args, **kwargs)
        return wrapped
    if original is not None:
        dist.all_gather_single = count(original)
    dist.all_gather_into_tensor = count(original_into)
    try:
        return run(), len(calls)
    finally:
        if original is not None:
            dist.all_gather_single = original
        dist.all_gather_into_tensor = original_into


def _worker(rank: int) -> dict:
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the test instead of stalling the suite
    alone_model = widened_model("tiny")
    prompts = rank_prompts(rank, alone_model.args.vocab_size)
    uniforms = rank_uniforms(rank, prompts)
    alone = decode_slots(alone_model, prompts, CFG, CPU, uniforms)
    model = widened_model("tiny")
    mesh = init_device_mesh("cpu", (2,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results = {"alone": [(d.tokens, d.logps, d.stopped) for d in alone]}
    per_layer = EngineStats()
    got, gathers = counted_all_gathers(lambda: decode_slots(model, prompts, CFG, CPU, uniforms, stats=per_layer,
                                                            lockstep=Lockstep(multiple=1)))
    results["per_layer"] = [(d.tokens, d.logps, d.stopped) for d in got]
    results["per_layer_stats"] = vars(per_layer) | {"all_gathers": gathers}
    once = EngineStats()
    with gathered_once(model):
        got, gathers = counted_all_gathers(lambda: decode_slots(model, prompts, replace(CFG), CPU, uniforms,
                                                                stats=once))
    results["once"] = [(d.tokens, d.logps, d.stopped) for d in got]
    results["once_stats"] = vars(once) | {"all_gathers": gathers}
    faulthandler.cancel_dump_traceback_later()
    return results


def test_unequal_work_per_rank_decodes_in_lockstep_or_alone_as_one_process(tmp_path):
    ranks = gloo_results(_worker, 2, tmp_path)
    for r in ranks:
        for layout in ("per_layer", "once"):
            assert [t for t, _, _ in r[layout]] == [t for t, _, _ in r["alone"]], layout
            assert [s for _, _, s in r[layout]] == [s for _, _, s in r["alone"]], layout
            for (_, got, _), (_, want, _) in zip(r[layout], r["alone"], strict=True):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    short, long = ranks[0]["per_layer_stats"], ranks[1]["per_layer_stats"]
    # the work was unequal: rank 0 ends early, with fewer prefills of its own
    assert max(len(t) for t, _, _ in ranks[0]["alone"]) < max(len(t) for t, _, _ in ranks[1]["alone"])
    assert ranks[1]["once_stats"]["decode_steps"] > ranks[0]["once_stats"]["decode_steps"]
    # layer by layer: the same forwards on both ranks, rank 0's extra ones idle
    assert short["decode_steps"] == long["decode_steps"] and short["all_gathers"] == long["all_gathers"] > 0
    assert short["prefill_forwards"] + short["idle_prefills"] == long["prefill_forwards"] + long["idle_prefills"]
    assert short["idle_prefills"] > 0 and short["prefill_forwards"] < long["prefill_forwards"]
    # gathered once: no decode forward all-gathers anything
    assert ranks[0]["once_stats"]["all_gathers"] == ranks[1]["once_stats"]["all_gathers"] == 0
