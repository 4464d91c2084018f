"""Faults met while training: stop signals (a graceful stop at a step boundary), non-finite values, hung collectives."""

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A scheduler that signals every process of a job reaches a rank both directly and through its launcher: copies of
# the first signal that arrive this soon after it are the same request.
SAME_REQUEST_SECONDS = 1.0


class StopSignals:
    """The first SIGTERM or SIGINT asks for a stop at the next step boundary (with a checkpoint); a second one exits
    at once with 128 + the signal number, saving nothing."""

    def __init__(self, exit_now: Callable[[int], None] = os._exit):
        self.name: str | None = None
        self.first_at: float | None = None
        self.exit_now = exit_now

    @property
    def requested(self) -> bool:
        return self.name is not None

    def handle(self, signum: int, frame=None) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at, self.name = now, signal.Signals(signum).name
            return
        if now - self.first_at < SAME_REQUEST_SECONDS:
            return
        os.write(2, f"{signal.Signals(signum).name} again: exiting at once, without a checkpoint\n".encode())
        self.exit_now(128 + signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignals"]:
        """Handle the stop signals while the block runs (the main thread only); the previous handlers after it."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on one of them (e.g. a stop request: all ranks stop after the same
    step). A collective of the default process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def collective_device() -> torch.device:
    """Where the default process group reduces: the CPU for gloo, the current accelerator for nccl/xccl."""
    if dist.get_backend() == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


# ------------------------------------------------------------------------------------------ non-finite values


def nonfinite_message(step: int, loss: float, grad_norm: float) -> str | None:
    """What is not finite on this step (the loss and grad norm are global, so every rank sees the same), or None."""
    bad = [f"{name} is {value}" for name, value in (("the loss", loss), ("the gradient norm", grad_norm))
           if not math.isfinite(value)]
    return f"step {step}: {' and '.join(bad)}" if bad else None


def nonfinite_parameter(named_params: Iterator[tuple[str, torch.Tensor]]) -> str | None:
    """The name of a parameter of this rank holding NaN or infinity, or None."""
    for name, param in named_params:
        local = param.to_local() if hasattr(param, "to_local") else param
        if not bool(torch.isfinite(local).all()):
            return name
    return None


# ------------------------------------------------------------------------------------------ hung collectives


class Activity:
    """What this rank is doing, named for a report when one of its collectives times out."""

    def __init__(self):
        self.what = "starting"
        self.timeout_key = "comm.init_timeout_seconds"
        self.timeout_seconds: float | None = None

    def now(self, what: str) -> None:
        self.what = what

    def timeout(self, key: str, seconds: float) -> None:
        self.timeout_key, self.timeout_seconds = key, seconds


ACTIVITY = Activity()  # one per process, like the process group whose timeouts it reports


def is_collective_timeout(exc: BaseException) -> bool:
    """A collective (or the rendezvous) gave up waiting for another rank: gloo, NCCL and the store all say so."""
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


def timeout_line(exc: BaseException, rank: int, world: int) -> str:
    """One line: which rank, doing what, waited how long under which key, and what the backend said."""
    a = ACTIVITY
    waited = f" after {a.timeout_seconds:g} s ('{a.timeout_key}')" if a.timeout_seconds is not None else ""
    backend = " ".join(str(exc).split())
    if len(backend) > 200:
        backend = backend[:200] + "..."
    return (f"rank {rank} of {world} timed out{waited} in a collective while {a.what}: another rank did not join "
            f"(stuck or dead: see its log); backend: {backend}")

