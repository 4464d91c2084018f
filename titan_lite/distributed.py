"""Process-group and device set-up: device, compute dtype, backend (COMM_BACKEND), flight recorder, seeds, teardown."""

import contextlib
import ctypes
import os
import random
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from titan_lite.config.schema import Comm
from titan_lite.errors import ConfigError
from titan_lite.launcher import local_launch, publish_store_port, wait_for_store_port

# The flight-recorder variables: the name set here first, then the other names torch reads for the same setting.
_FR_BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch 2.13 warns on the second
_FR_DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
_FR_DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def device_type() -> str:
    """'cuda' (or another accelerator's type) when one is visible, else 'cpu'; initialises no device."""
    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"


def local_device() -> torch.device:
    """This process's device: the accelerator at LOCAL_RANK when one is visible, else the CPU."""
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.accelerator.device_count()
        torch.accelerator.set_device_index(index)
        return torch.device(accelerator.type, index)
    return torch.device("cpu")


def compute_dtype(mixed_precision_param: str, device_type: str) -> torch.dtype:
    """The compute dtype: 'auto' means bfloat16 on accelerators and float32 on CPUs (bf16 matmuls are slow there)."""
    if mixed_precision_param == "auto":
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    return getattr(torch, mixed_precision_param)


def default_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")


def choose_backend(device: torch.device) -> str:
    """COMM_BACKEND if set (checked), else nccl on CUDA and gloo on CPU."""
    backend = os.environ.get("COMM_BACKEND") or default_backend(device)
    if backend != "fake" and not dist.is_backend_available(backend):
        raise ConfigError(f"COMM_BACKEND={backend} is not available in this torch build on device '{device.type}'; "
                          f"use {default_backend(device)}")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"COMM_BACKEND=nccl needs CUDA devices, but this process runs on '{device.type}'; use gloo")
    return backend


def configure_flight_recorder(comm: Comm, dump_folder: str, backend: str) -> None:
    """Set the NCCL flight-recorder variables from [comm] before the process group exists (gloo ignores them).

    A buffer size > 0 also dumps the recorded collectives on a timeout, one file per rank named
    {dump_folder}/{comm.save_traces_folder}/{comm.save_traces_file_prefix}{rank}; the folder is created for an
    NCCL group only (NCCL writes there, it does not create it) and removed at the end if nothing was dumped
    (remove_empty_trace_folder). A variable the user set (under either of its names) is left alone.
    """
    _set_unless_present(_FR_BUFFER_SIZE, str(comm.trace_buf_size))
    if comm.trace_buf_size <= 0:
        return
    _set_unless_present(_FR_DUMP_ON_TIMEOUT, "1")
    folder = os.path.join(dump_folder, comm.save_traces_folder)
    if _set_unless_present(_FR_DUMP_FILE, os.path.join(folder, comm.save_traces_file_prefix)) and backend == "nccl":
        os.makedirs(folder, exist_ok=True)


def remove_empty_trace_folder(comm: Comm, dump_folder: str) -> None:
    """The flight-recorder folder, left only when a dump is in it."""
    with contextlib.suppress(OSError):  # not there, or holds a dump
        os.rmdir(os.path.join(dump_folder, comm.save_traces_folder))


def _set_unless_present(names: tuple[str, ...], value: str) -> bool:
    """Set names[0] to value unless one of names is already in the environment; True when it was set."""
    if any(name in os.environ for name in names):
        return False
    os.environ[names[0]] = value
    return True


def init_process_group(device: torch.device, timeout_s: int) -> None:
    """Join the job's process group: torchrun's (WORLD_SIZE > 1, or a torchelastic launch), else a group of one."""
    if dist.is_initialized():
        return
    backend = choose_backend(device)
    kwargs = {"device_id": device} if device.type != "cpu" else {}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        store = local_launch_store(timeout_s)
        extra = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                          "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs, **extra)
        return
    # plain `python -m titan_lite.train`, a script, run_train.sh's one rank: a group of one on an in-memory store, so
    # no port is taken (a MASTER_ADDR/MASTER_PORT exported for another job, e.g. in a SLURM script, is not used); the
    # environment is left as it is (RANK, WORLD_SIZE absent read as 0 and 1)
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s), **kwargs)


def local_launch_store(timeout_s: int) -> dist.TCPStore | None:
    """The rendezvous store of run_train.sh's one-node launch (titan_lite.launcher --local): rank 0 opens it on an
    ephemeral port of 127.0.0.1 and publishes the port; None under torchrun or a launch of one's own (env://)."""
    if not local_launch():
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        publish_store_port(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", wait_for_store_port(rank, timeout_s), world, is_master=False,
                              timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)  # for code that reads the rendezvous from the environment
    return store


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this process (the world, the mesh's groups, the checkpointer's) gives up on a
    collective after `seconds`; groups made by new_group or a device mesh otherwise wait 30 minutes."""
    timeout = timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map):  # no public list of a process's groups
        group.set_timeout(timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous a test or benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory(device: torch.device) -> bool:
    """On CPU under glibc, serve large tensors from malloc's heap and keep freed memory there for the next step.

    By default glibc maps every allocation above its mmap threshold (at most 32 MiB) afresh and unmaps it when it is
    freed, so each training step page-faults its activations, logits and gradients in again and the kernel zeroes
    every page: on a 512-dim model with a 32k vocabulary about 700 MiB a step, a tenth of the step's CPU time. One
    arena for all threads: gloo's threads (FSDP's collectives) otherwise allocate from arenas of their own, which
    return memory on their own terms (2 FSDP processes on that model page-faulted 45k-51k times a step, against
    14k-16k with one arena). The process's peak memory is unchanged (it reaches that peak every step anyway).
    TITAN_LITE_CPU_MALLOC=default keeps glibc's behaviour. Returns whether the setting was applied.
    """
    if device.type != "cpu" or not sys.platform.startswith("linux") or \
            os.environ.get("TITAN_LITE_CPU_MALLOC") == "default":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1))
    return all(bool(mallopt(key, value)) for key, value in settings)


def set_seed(seed: int, deterministic: bool, warn_only: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def shutdown() -> None:
    """Barrier, then destroy: gloo sometimes aborts at exit when a rank leaves early."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def shutdown_quietly() -> None:
    """Destroy the group without a barrier: used when this rank stops on an error others may not share."""
    if dist.is_initialized():
        dist.destroy_process_group()
