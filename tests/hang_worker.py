"""The worker of test_faults' hung-collective test, in its own module so spawned ranks import only torch and faults."""

import json
import time

import torch
import torch.distributed as dist

from titan_lite.distributed import set_collective_timeout
from titan_lite.errors import HANG
from titan_lite.faults import ACTIVITY, is_collective_timeout, timeout_line


def one_rank_hangs(rank: int, result_file: str) -> None:
    """Rank 1 never joins; rank 0's all-reduce on a subgroup (30 minutes by default) gives up after 2 s and writes
    (exit code, line) as the trainer's entry point would report them."""
    group = dist.new_group([0, 1])
    set_collective_timeout(2)
    ACTIVITY.timeout("comm.train_timeout_seconds", 2)
    ACTIVITY.now("in step 7 (forward, backward, gradient reductions)")
    if rank == 1:
        time.sleep(3)
    else:
        try:
            dist.all_reduce(torch.ones(1), group=group)
            outcome = None
        except RuntimeError as exc:
            outcome = [HANG, timeout_line(exc, 0, 2)] if is_collective_timeout(exc) else repr(exc)
        with open(result_file, "w") as f:
            json.dump(outcome, f)
    set_collective_timeout(60)  # for the closing barrier on the world group
