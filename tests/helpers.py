"""Helpers shared by the unit tests: a free TCP port, and worker functions run in a fresh gloo process group."""

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_lite.distributed import free_port

__all__ = ["free_port", "spawn_gloo", "spawn_on_free_port"]

_PORT_TAKEN = ("EADDRINUSE", "address already in use")


def spawn_on_free_port(worker: Callable[..., None], nprocs: int, *args,
                       results_complete: Callable[[], bool] | None = None) -> None:
    """mp.spawn(worker, args=(port, *args)) on a port free a moment ago; once more on a new port if another process
    took it in between (the rendezvous then fails with EADDRINUSE), so a port race is not a test failure.

    results_complete: for workers that write their results to files before a final barrier; a rank killed by a
    signal once they are all written died in the process group's teardown (gloo's threads now and then abort at
    exit: "terminate called without an active exception"), which is not what the test checks."""
    for attempt in range(2):
        try:
            mp.spawn(worker, args=(free_port(), *args), nprocs=nprocs, join=True)
            return
        except mp.ProcessExitedException:
            if results_complete is None or not results_complete():
                raise
            return
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

    from titan_lite.models.llama.args import flavor_args
    from titan_lite.models.llama.hf import args_to_hf_config

    folder = Path(folder)
    shutil.copytree(Path(__file__).resolve().parents[1] / "assets" / "tokenizer", folder)
    args = flavor_args("tiny")
    args.tie_word_embeddings = True
    (folder / "config.json").write_text(json.dumps(args_to_hf_config(args, torch.float32)))
    return str(folder)
