"""Helpers shared by the unit tests: a free TCP port, and worker functions run in a fresh gloo process group."""

import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_lite.distributed import free_port

__all__ = ["free_port", "gloo_results", "spawn_gloo", "spawn_on_free_port"]

# What the forkserver imports before it forks the workers (tests/conftest.py sets it): torch's modules only, never
# titan_lite (Python 3.11's forkserver imports these before it takes the caller's sys.path, so it could find another
# checkout's titan_lite).
FORKSERVER_PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
                      "torch._dynamo", "torch.nn.attention.flex_attention"]
_PORT_TAKEN = ("EADDRINUSE", "address already in use")


def spawn_on_free_port(worker: Callable[..., None], nprocs: int, *args,
                       results_complete: Callable[[], bool] | None = None) -> None:
    """mp.spawn(worker, args=(port, *args)) on a port free a moment ago, the processes forked from multiprocessing's
    forkserver (FORKSERVER_PRELOAD: torch is imported there once, not in each process); once more on a new port if
    another process took it in between (the rendezvous then fails with EADDRINUSE), so a port race is not a test
    failure.

    results_complete: for workers that write their results to files before a final barrier; a rank killed by a
    signal once they are all written died in the process group's teardown (gloo's threads now and then abort at
    exit: "terminate called without an active exception"), which is not what the test checks.

    A rank killed by a signal before that (CI once saw "malloc(): unaligned tcache chunk detected" in a 2-rank gloo
    run that passes alone, time after time) is run once more: a native abort that comes back is raised."""
    for attempt in range(2):
        try:
            mp.start_processes(worker, args=(free_port(), *args), nprocs=nprocs, join=True,
                               start_method="forkserver")
            return
        except mp.ProcessExitedException as error:
            if results_complete is not None and results_complete():
                return
            if attempt:
                raise
            print(f"spawn_on_free_port: {error}; running the workers once more", file=sys.stderr)
        except mp.ProcessRaisedException as error:
            if attempt or not any(sign in str(error) for sign in _PORT_TAKEN):
                raise


def spawn_gloo(worker: Callable[..., None], world_size: int, *args) -> None:
    """Run worker(rank, *args) in world_size new processes that share one gloo process group; wait for all of them.

    worker must be a module-level function (the processes are spawned, so it is pickled by name). A failure in any
    process is raised here.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn_on_free_port(_in_gloo_group, world_size, world_size, worker, args)


def gloo_results(worker: Callable[..., dict], world_size: int, out_dir, *args) -> list[dict]:
    """Every rank's worker(rank, *args), a JSON-able dict, from world_size processes sharing one gloo group. Each
    rank writes its dict whole before the final barrier, so a rank that dies in gloo's teardown after that (see
    spawn_on_free_port) is not a failure."""
    from pathlib import Path

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    files = [Path(out_dir) / f"rank{rank}.json" for rank in range(world_size)]
    spawn_on_free_port(_in_gloo_group, world_size, world_size, _write_result, (str(out_dir), worker, args),
                       results_complete=lambda: all(f.exists() for f in files))
    return [json.loads(f.read_text()) for f in files]


def _write_result(rank: int, out_dir: str, worker: Callable[..., dict], args: tuple) -> None:
    result = worker(rank, *args)
    partial = os.path.join(out_dir, f".rank{rank}.json")
    with open(partial, "w") as f:
        json.dump(result, f)
    os.replace(partial, os.path.join(out_dir, f"rank{rank}.json"))  # whole or absent


def _in_gloo_group(rank: int, port: int, world_size: int, worker: Callable[..., None], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        worker(rank, *args)
        dist.barrier()  # gloo sometimes aborts at exit when a rank leaves early
    finally:
        dist.destroy_process_group()


def tied_tiny_assets(folder) -> str:
    """A copy of the bundled tokenizer folder plus a config.json of the tiny flavor with tied embeddings (flavor hf)."""
    import json
    import shutil
    from pathlib import Path

    from titan_lite.models.flavors import flavor_args
    from titan_lite.models.hf.config import args_to_hf_config

    folder = Path(folder)
    shutil.copytree(Path(__file__).resolve().parents[1] / "assets" / "tokenizer", folder)
    args = flavor_args("tiny")
    args.tie_word_embeddings = True
    (folder / "config.json").write_text(json.dumps(args_to_hf_config(args, torch.float32)))
    return str(folder)


# Small random models of each family as transformers builds them (the oracle of the family tests); keys are the
# HF model_type. Shapes like the "tiny" flavor; Qwen3 with head_dim 32 != hidden / heads and tied embeddings, Mistral
# with a window (8) shorter than the tests' sequences.
HF_FAMILY_SHAPES = {
    "qwen2": dict(rope_theta=1000000.0),
    "qwen3": dict(head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0),
    "mistral": dict(sliding_window=8),
    # 8 experts of width 32, top 2 renormalised, layer 1 dense (mlp_only_layers): every MoE option in 3 layers
    "qwen3_moe": dict(head_dim=32, rope_theta=1000000.0, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    # Mixtral: every layer MoE, intermediate_size the experts' width; a window shorter than the tests' sequences
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0,
                    sliding_window=8),
}


def hf_family_model(family: str, seed: int = 0, vocab_size: int = 2048, **overrides):
    """A small random transformers model of one family with every weight (norms and biases too) perturbed, in eval
    mode; `overrides` change its config."""
    import transformers

    classes = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}
    config_class, model_class = classes[family]
    kwargs = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab_size, rms_norm_eps=1e-6, max_position_embeddings=128)
    kwargs.update(HF_FAMILY_SHAPES[family])
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def hf_family_folder(folder, family: str, seed: int = 0, **overrides) -> str:
    """hf_family_model saved by transformers with the bundled tokenizer (vocabulary 2048) beside it."""
    import shutil
    from pathlib import Path

    folder = Path(folder)
    hf_family_model(family, seed, **overrides).save_pretrained(folder)
    shutil.copy2(Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "tokenizer.model", folder)
    return str(folder)
