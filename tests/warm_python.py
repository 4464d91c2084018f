"""A warm start for the test session's launches: run_train.sh runs unchanged, but its python starts in milliseconds.

Each launch of run_train.sh imports torch and titan_lite (`import titan_lite.train` alone: 4.42 to 5.11 s of CPU on
this 2-core machine) before the trainer does anything, and the suite launches it hundreds of times.
`start(folder)` starts a server that has imported them once and makes a virtual-environment folder whose `bin/python` is
tests/warm_client.py; pointing TITAN_LITE_VENV at it (scripts/setup_env.sh's own setting) makes every run_train.sh of
the session use it, and python_command() gives it to the tests that start scripts. For `-m MODULE ...` and
`SCRIPT.py ...` the server forks a child that runs them as python would: in its own session, with the caller's
arguments, environment, working directory and standard streams. An environment that differs from the server's in
what the interpreter reads when it starts (OMP_*, PYTHON*, TORCH*, ...) runs a cold python instead, as does anything
else run_train.sh asks of python. TITAN_LITE_TEST_WARM=0 switches it off.
"""

import atexit
import contextlib
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

from titan_lite.launcher import exit_code_of

REPO = Path(__file__).resolve().parents[1]
# Read when the interpreter, torch or a native library starts: a launch whose values differ runs cold. (Not the
# TORCH_* settings read when a process group starts, e.g. TORCH_FR_BUFFER_SIZE, which a trainer built in a test's own
# process exports: the child's environment is the caller's.)
STARTUP_ENV_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "MALLOC_", "GLIBC_", "TORCHINDUCTOR_",
                        "TORCHDYNAMO_", "TORCH_COMPILE", "TORCH_LOGS", "TORCH_SHOW_CPP", "PYTORCH_", "CUDA_",
                        "TITAN_LITE_TEST_WARM")

# start() waits this long for the server to listen (~5 s of imports on a busy CI core): a launch before it would pay
# those seconds itself.
READY_TIMEOUT_S = 30
WARM_MARKER = ".titan_lite_test_warm"  # in the session's warm venv folder
COLD = {"TITAN_LITE_TEST_WARM": "0"}  # in a launch's environment: a cold python, whatever the session's setting


# Exported by torch's own import (torch._inductor.config sets the default cache folder): a caller that has not
# imported it yet would get the same value.
SET_BY_TORCH = ("TORCHINDUCTOR_CACHE_DIR",)


def python_command() -> list[str]:
    """What a test runs in place of [sys.executable] for `-m MODULE ...` or `SCRIPT.py ...`: the session's warm
    python while it is serving, otherwise this interpreter."""
    venv = os.environ.get("TITAN_LITE_VENV")
    if os.environ.get("TITAN_LITE_TEST_WARM") == "0" or not venv or not (Path(venv) / WARM_MARKER).exists():
        return [sys.executable]
    return [str(Path(venv) / "bin" / "python")]


def startup_env(env: dict, server_env: dict | None = None) -> dict:
    """The settings a launch must share with the server; PYTHONPATH as its folders (run_train.sh repeats the
    checkout's); what torch exports itself when imported is the server's where the launch lacks it."""
    found = {k: v for k, v in env.items() if k.startswith(STARTUP_ENV_PREFIXES)}
    for key in SET_BY_TORCH:
        if key not in found and server_env and key in server_env:
            found[key] = server_env[key]
    if "PYTHONPATH" in found:
        found["PYTHONPATH"] = ":".join(dict.fromkeys(p for p in found["PYTHONPATH"].split(":") if p))
    return found


def run_train_env(env: dict) -> dict:
    """The environment run_train.sh gives its python (it puts the checkout first on PYTHONPATH)."""
    pythonpath = env.get("PYTHONPATH")
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": f"{REPO}:{pythonpath}" if pythonpath else str(REPO)}


def start(folder: Path) -> tuple[subprocess.Popen, Path]:
    """The server (a child of this process, which it outlives by at most a second), listening, and the folder to
    give as TITAN_LITE_VENV."""
    folder.mkdir(parents=True, exist_ok=True)
    sock = folder / "server.sock"
    venv = folder / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -IS {REPO / "tests" / "warm_client.py"} '
                      f'{sys.executable} {sock} "$@"\n')
    python.chmod(0o755)
    # setup_env.sh: ready, nothing to install
    for marker in (".titan_lite_ready", ".titan_lite_ready_test", WARM_MARKER):
        (venv / marker).touch()
    server = subprocess.Popen([sys.executable, "-m", "tests.warm_python", str(sock), str(os.getpid())], cwd=REPO,
                              env=run_train_env(dict(os.environ)), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=open(folder / "server.log", "w"))
    ready = time.monotonic() + READY_TIMEOUT_S
    while not sock.exists() and server.poll() is None and time.monotonic() < ready:
        time.sleep(0.05)
    return server, venv


# ------------------------------------------------------------------------------------------ the server


def serve(sock_path: str, parent: int) -> None:
    import torch._inductor.config  # noqa: F401 - exports its default TORCHINDUCTOR_CACHE_DIR, as a caller's import would

    import titan_lite.launcher
    import titan_lite.train

    titan_lite.train.preload()
    gc.freeze()  # as titan_lite.launcher --preload does: the children's collections skip the imported objects
    own_startup_env = startup_env(dict(os.environ))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sock_path + ".tmp")
    os.replace(sock_path + ".tmp", sock_path)  # clients find it only once it listens
    listener.listen(64)
    runs: dict[int, socket.socket] = {}  # child pid -> its client's connection
    argvs: dict[int, list[str]] = {}
    while os.getppid() == parent:
        watched = [c for c in runs.values() if c.fileno() >= 0]
        readable, _, _ = select.select([listener, wake_r, *watched], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        reap(runs, argvs)
        for conn in readable:
            if conn is listener:
                accept(listener, runs, argvs, own_startup_env, [listener, wake_r, wake_w])
            elif conn in runs.values() and client_gone(conn):  # killed (a test's timeout): end its run
                pid = next(p for p, c in runs.items() if c is conn)
                conn.close()  # not watched again; reaped as any other run
                end_run(pid)
    for pid in runs:
        end_run(pid)


def client_gone(conn: socket.socket) -> bool:
    try:
        return not conn.recv(64, socket.MSG_PEEK)
    except OSError:
        return True


def end_run(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def reap(runs: dict[int, socket.socket], argvs: dict[int, list[str]]) -> None:
    """Tell the clients of the runs that ended how they ended; log each run's CPU seconds (its ranks' included)."""
    for pid in list(runs):
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            print(f"run: {usage.ru_utime + usage.ru_stime:.1f} CPU s: {' '.join(argvs.pop(pid))}", file=sys.stderr,
                  flush=True)
            conn = runs.pop(pid)
            with contextlib.suppress(OSError):
                conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            conn.close()


def accept(listener: socket.socket, runs: dict, argvs: dict, own_startup_env: dict, server_fds: list) -> None:
    conn, _ = listener.accept()
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        request = json.loads(message)
    except (OSError, ValueError):
        conn.close()
        return
    theirs = startup_env(request["env"], own_startup_env)
    if len(fds) != 3 or theirs != own_startup_env:
        differing = sorted(k for k in theirs.keys() | own_startup_env.keys() if theirs.get(k) != own_startup_env.get(k))
        print(f"cold: {' '.join(request['argv'][:2])}: the environment differs in {', '.join(differing)}",
              file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(b"cold")
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        conn.close()
        for sock in [listener, *runs.values()]:
            sock.close()
        signal.set_wakeup_fd(-1)
        for fd in server_fds[1:]:
            os.close(fd)
        run_child(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    runs[pid], argvs[pid] = conn, request["argv"]
    try:
        conn.send(f"pid {pid}".encode())
    except OSError:  # the client is gone already
        conn.close()
        end_run(pid)


def run_child(request: dict, fds: list[int]) -> None:
    """`python ARGV` as the client would have run it, then os._exit with its status."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        fresh_stdio()
        atexit._clear()  # the server's exit functions are not this run's
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = request["cwd"]  # python -m puts the working directory first
            sys.modules.pop(argv[1], None)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # python SCRIPT puts the script's folder first
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exit_code_of(exc)
    except BaseException:  # noqa: BLE001 - what python prints for an uncaught exception, exit 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def fresh_stdio() -> None:
    """Standard streams over the caller's descriptors, buffered as a new interpreter would buffer them."""
    def text(fd: int, mode: str, line: bool, errors: str):
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding="utf-8", errors=errors, line_buffering=line)
    sys.stdin = sys.__stdin__ = text(0, "r", False, "strict")
    sys.stdout = sys.__stdout__ = text(1, "w", os.isatty(1), "strict")
    sys.stderr = sys.__stderr__ = text(2, "w", True, "backslashreplace")


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
