"""run_train.sh's supervisor of a node's ranks: stop signals reach the ranks once, a rank's error ends the run in one
line.

`python -m titan_lite.launcher --local N [--log-ranks 0,1] <python arguments>` (one node, no restarts) starts the N
ranks itself; `python -m titan_lite.launcher <torchrun arguments>` (several nodes, or restarts) runs torchrun as a
child. Either speaks a small protocol with the ranks of this node through a folder it creates for the launch
(TITAN_LITE_LAUNCH_DIR):

- rank{R}.pid    written by each rank when it starts. SIGTERM and SIGINT sent to the launcher go straight to these
                 processes (the trainer stops at the next step boundary after saving a checkpoint; a second signal
                 stops it at once); before any rank has started, they end the launch. torchrun itself ignores
                 SIGTERM and SIGINT: it would forward them and kill the ranks after 30 s, in the middle of a large
                 save. SIGHUP (a closed terminal) is left to torchrun, which shuts the ranks down.
- rank{R}.error  "<exit code>\\n<one line>" written by a rank that stops on a user error (2), a training fault (3)
                 or a hung collective (4), instead of printing it. The launcher prints the line of the lowest rank
                 once, holds back torchrun's own failure report and traceback, and exits with that code. Codes 2 and
                 3 cannot be fixed by restarting, so the launcher ends torchrun at once (no --max_restarts rounds).
- store.port     (--local with N > 1) the port of the rendezvous store rank 0 opened on 127.0.0.1 (an ephemeral
                 one: two launches on one machine never race for a port); the other ranks connect to it.

Everything else passes through: the ranks' output as `[rankN]:` lines (of the ranks --log-ranks or torchrun's
--local-ranks-filter names) as it comes, torchrun's own lines as well unless the run ends in one of the single-line
outcomes above. A rank of --local that dies without a line of its own (a crash) ends the others and the launch with
`error: rank R ...` and, when its output was not shown, the last lines it printed. This module imports no torch, so
it costs nothing at launch; the rank-side functions at the bottom are what the trainer calls.

`--local N --preload` (run_train.sh's choice on a machine without GPUs) imports the ranks' module once in the
launcher and forks the ranks from it: a rank's ~5 s of importing torch and titan_lite on a CPU is paid once per
launch instead of once per rank. Not on GPU machines: a process forked after something touched CUDA cannot use it.

Why --local: torchrun's own start and shutdown cost about 4 s per launch on a CPU and do nothing that one node
without restarts needs.
"""

import collections
import contextlib
import gc
import importlib
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from titan_lite.errors import FAULT, USER_ERROR

LAUNCH_DIR_ENV = "TITAN_LITE_LAUNCH_DIR"
STDOUT_IS_TTY_ENV = "TITAN_LITE_STDOUT_IS_TTY"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Signals torchrun keeps handling (it forwards them to the ranks and shuts down): SIGHUP ends a run whose ranks have
# not started yet, and a run whose rank reported an error that a restart cannot fix.
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"
NOT_RESTARTABLE = (USER_ERROR, FAULT)
POLL_SECONDS = 0.2
LOCAL_STORE_ENV = "TITAN_LITE_LOCAL_STORE"
STORE_PORT_FILE = "store.port"
# After a --local rank fails, the others get this long to end on their own (each may report its own line) before
# they are killed; a crashed rank not shown (LOG_RANK) has this many of its last lines printed.
CRASH_GRACE_SECONDS, CRASH_TAIL_LINES = 3.0, 40


@dataclass
class RankError:
    rank: int
    code: int
    message: str


# ------------------------------------------------------------------------------------------ launcher side


class Launch:
    """The launch's children (one torchrun, or the ranks of --local), its folder, and what the launcher learned."""

    def __init__(self, command: list[str], local_ranks: int = 0, log_ranks: frozenset[int] = frozenset(),
                 preload: bool = False):
        self.folder = Path(tempfile.mkdtemp(prefix="titan_lite_launch_"))
        self.signals: list[int] = []
        self.held: list[bytes] = []  # torchrun's own stderr lines, printed at the end unless the run ends in one line
        self.ended = False
        self.stopped_before_start = False
        self.local = local_ranks > 0
        self.log_ranks = log_ranks
        self.tails = {rank: collections.deque(maxlen=CRASH_TAIL_LINES) for rank in range(local_ranks)}
        env = {**os.environ, LAUNCH_DIR_ENV: str(self.folder), STDOUT_IS_TTY_ENV: "1" if sys.stdout.isatty() else "0",
               "PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS}
        self.procs = []
        for sig in FORWARDED_SIGNALS:  # a stop while the module is preloaded: no rank is started
            signal.signal(sig, self.forward)
        start = ForkedRank if self.local and preload and preload_module(command) else start_rank
        # The children start with SIGTERM/SIGINT ignored (the ranks install their own handlers).
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if self.stopped_before_start:
            pass
        elif self.local:
            self.procs = [start(command, rank_env(env, rank, local_ranks)) for rank in range(local_ranks)]
        else:
            self.procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command], env=env,
                                           stderr=subprocess.PIPE)]
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self.forward)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # torchrun gets its own and shuts down; keep relaying its output

    def rank_pids(self) -> list[int]:
        pids = []
        for path in self.folder.glob("rank*.pid"):
            try:
                pids.append(int(path.read_text()))
            except (OSError, ValueError):
                continue  # a rank writing its file right now
        return pids

    def forward(self, signum: int, frame) -> None:
        """A stop signal: to every rank that has started; before any has, the launch ends."""
        self.signals.append(signum)
        pids = self.rank_pids()
        if not pids:
            self.stopped_before_start = True
            self.end()
            return
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass  # that rank already exited

    def end(self) -> None:
        """torchrun shuts its ranks down on SIGHUP; ranks of --local are killed (they are not saving anything a
        user asked for: this ends a launch that failed or was stopped before it started)."""
        if self.ended:
            return
        self.ended = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL if self.local else signal.SIGHUP)

    def errors(self) -> list[RankError]:
        return sorted((e for e in map(read_error, self.folder.glob("rank*.error")) if e is not None),
                      key=lambda e: e.rank)

    def one_line_outcome(self) -> bool:
        """Whether the run ends with a single line of ours: an error a rank reported, a second signal, or a stop
        before any rank started."""
        return bool(self.errors()) or len(self.signals) >= 2 or self.stopped_before_start

    def watch(self) -> None:
        """Background: end the launch as soon as a rank reports an error that restarting cannot fix, or (--local)
        once a rank has failed and the others have not followed within CRASH_GRACE_SECONDS."""
        failed_at = None
        while any(proc.poll() is None for proc in self.procs):
            if any(e.code in NOT_RESTARTABLE for e in self.errors()):
                self.end()
                return
            if self.local and failed_at is None and any(proc.poll() not in (None, 0) for proc in self.procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > CRASH_GRACE_SECONDS:
                self.end()
                return
            time.sleep(POLL_SECONDS)

    def relay(self, stream, out, prefix: bytes = b"", rank: int | None = None) -> None:
        """One child's stream, line by line: a rank's lines pass through at once (or, for a rank not shown, are
        kept for a crash report); torchrun's own are held back once the run ends in one line."""
        for line in iter(stream.readline, b""):
            line = prefix + line
            if rank is not None and rank not in self.log_ranks:
                self.tails[rank].append(line)
            elif line.startswith(b"[rank") or not self.one_line_outcome():
                out.write(line)
                out.flush()
            else:
                self.held.append(line)

    def wait(self) -> int:
        threading.Thread(target=self.watch, daemon=True).start()
        relays = []
        for rank, proc in enumerate(self.procs):
            prefix, who = (f"[rank{rank}]:".encode(), rank) if self.local else (b"", None)
            streams = [(proc.stderr, sys.stderr.buffer)] + ([(proc.stdout, sys.stdout.buffer)] if self.local else [])
            for stream, out in streams:
                relays.append(threading.Thread(target=self.relay, args=(stream, out, prefix, who), daemon=True))
        for relay in relays:
            relay.start()
        codes = [proc.wait() for proc in self.procs]
        for relay in relays:
            relay.join()
        codes = [code if code >= 0 else 128 - code for code in codes]
        if not self.local:
            return self.outcome(codes[0])
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        return self.outcome(0 if not failed else 1, crash=self.first_failure(failed))

    def first_failure(self, failed: list[tuple[int, int]]) -> tuple[int, int] | None:
        """(rank, exit code) of the rank that failed first, the one whose death the others followed."""
        if not failed:
            return None
        killed_by_us = 128 + signal.SIGKILL
        own = [f for f in failed if f[1] != killed_by_us] or failed
        return own[0]

    def outcome(self, code: int, crash: tuple[int, int] | None = None) -> int:
        errors = self.errors()
        if self.stopped_before_start:
            name = signal.Signals(self.signals[0]).name
            print(f"stopped by {name} before any rank started: nothing to save", file=sys.stderr, flush=True)
            return 0
        if code == 0:
            self.print_held()
            return 0
        if errors:
            first = errors[0]
            print(f"error: {first.message}", file=sys.stderr, flush=True)
            return first.code
        if len(self.signals) >= 2:
            name = signal.Signals(self.signals[-1]).name
            print(f"error: stopped at once by a second {name}; the newest complete checkpoint is where the run "
                  "continues", file=sys.stderr, flush=True)
            return 128 + self.signals[-1]
        self.print_held()
        if crash is not None:
            self.report_crash(*crash)
        return code

    def report_crash(self, rank: int, code: int) -> None:
        tail = b"".join(self.tails[rank])
        if tail:
            sys.stderr.buffer.write(tail)
        how = f"was killed by {signal.Signals(code - 128).name}" if code > 128 else f"exited with code {code}"
        shown = "its last lines are above" if tail else "its output is above"
        print(f"error: rank {rank} {how} ({shown}); the other ranks were stopped", file=sys.stderr, flush=True)

    def print_held(self) -> None:
        sys.stderr.buffer.write(b"".join(self.held))
        sys.stderr.flush()

    def cleanup(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def start_rank(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def preload_module(command: list[str]) -> bool:
    """--preload: import the ranks' module (`-m MODULE`) here once, so that each rank forked from this process starts
    with it (and torch) imported; False (the ranks start as new processes) when it cannot be imported here."""
    if command[:1] != ["-m"] or len(command) < 2 or not hasattr(os, "fork"):
        return False
    try:
        module = importlib.import_module(command[1])
        getattr(module, "preload", lambda: None)()  # what each rank imports later anyway, imported once here
    except Exception:  # noqa: BLE001 - any import failure: the ranks, started afresh, print it
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the imported objects: a rank's garbage collections then leave their shared pages unwritten
    return True


class ForkedRank:
    """A rank forked from the launcher after --preload (a Popen's poll/wait/send_signal/pid/stdout/stderr): it runs
    `-m MODULE ARGS` as `python -m` would, then ends with os._exit, as a multiprocessing child does (the module's
    own exit path has closed its files; the interpreter's teardown costs about a second and frees nothing)."""

    def __init__(self, command: list[str], env: dict):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.close(err_r)
            run_forked(command, env, out_w, err_w)  # never returns
        os.close(out_w)
        os.close(err_w)
        self.pid, self.returncode = pid, None
        self.stdout, self.stderr = os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def run_forked(command: list[str], env: dict, out_w: int, err_w: int) -> None:
    """The forked rank: its output to the launcher's pipes, its environment, then the module as __main__."""
    code = 1
    try:
        for sig in FORWARDED_SIGNALS:  # as a started rank finds them (the launcher's handler is not its own)
            signal.signal(sig, signal.SIG_IGN)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        sys.argv = [command[1], *command[2:]]
        sys.modules.pop(command[1], None)  # runs as __main__ only, as under python -m (its imports stay loaded)
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exit_code_of(exc)
    except BaseException:  # noqa: BLE001 - what python -m prints for an uncaught exception, exit 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # the launcher gone, or the stream closed
                stream.flush()
        os._exit(code)


def exit_code_of(exc: SystemExit) -> int:
    """The status sys.exit(x) would end the interpreter with."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def rank_env(env: dict, rank: int, world: int) -> dict:
    """A --local rank's environment: what torchrun would give it on one node without restarts (a group of one
    finds its own store; a larger group meets at rank 0's, through the launch folder's store.port)."""
    out = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world)}
    out.pop("MASTER_PORT", None)  # one exported for another job is not this launch's
    if world == 1:
        out.pop("MASTER_ADDR", None)
    else:
        out.update({LOCAL_STORE_ENV: "1", "MASTER_ADDR": "127.0.0.1"})
    return out


def read_error(path: Path) -> RankError | None:
    try:
        code, message = path.read_text().split("\n", 1)
        return RankError(int(path.name.removeprefix("rank").removesuffix(".error")), int(code), message.strip())
    except (OSError, ValueError):
        return None  # being written


def parse_local(argv: list[str]) -> tuple[int, frozenset[int], bool, list[str]] | None:
    """(ranks, ranks shown, preload, python arguments) of `--local N [--log-ranks 0,1] [--preload] ...`; None for
    torchrun arguments."""
    if not argv or argv[0] != "--local":
        return None
    ranks, rest = int(argv[1]), argv[2:]
    shown, preload = frozenset(range(ranks)), False
    while rest[:1] in (["--log-ranks"], ["--preload"]):
        if rest[0] == "--preload":
            preload, rest = True, rest[1:]
        else:
            shown, rest = frozenset(int(r) for r in rest[1].split(",") if r.strip()), rest[2:]
    return ranks, shown, preload, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    local = parse_local(argv)
    launch = Launch(argv) if local is None else Launch(local[3], local_ranks=local[0], log_ranks=local[1],
                                                       preload=local[2])
    try:
        return launch.wait()
    finally:
        launch.cleanup()


# ------------------------------------------------------------------------------------------ rank side


def launch_folder() -> Path | None:
    folder = os.environ.get(LAUNCH_DIR_ENV)
    return Path(folder) if folder else None


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def register_rank() -> None:
    """Tell the launcher (if any) where to send stop signals; forget an error of this rank's previous attempt."""
    folder = launch_folder()
    if folder is None:
        return
    (folder / f"rank{_rank()}.error").unlink(missing_ok=True)
    _write_atomically(folder / f"rank{_rank()}.pid", str(os.getpid()))


def report_error(code: int, message: str) -> None:
    """The one line a rank stops with: to the launcher, which prints it once, or to stderr without one."""
    folder = launch_folder()
    if folder is None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return
    _write_atomically(folder / f"rank{_rank()}.error", f"{code}\n{message}\n")


def local_launch() -> bool:
    """Whether this rank is one of several that titan_lite.launcher --local started (they meet through its folder)."""
    return launch_folder() is not None and os.environ.get(LOCAL_STORE_ENV) == "1"


def publish_store_port(port: int) -> None:
    """--local's rank 0: the port of the rendezvous store it opened."""
    _write_atomically(launch_folder() / STORE_PORT_FILE, str(port))


def wait_for_store_port(rank: int, timeout_s: float) -> int:
    """--local's other ranks: the port rank 0 published."""
    path = launch_folder() / STORE_PORT_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise TimeoutError(f"rank {rank}: rank 0 did not open the rendezvous store within {timeout_s:.0f} s")


def another_rank_failed() -> bool:
    """Whether a rank of this node already reported an error (this rank's own failure is then a consequence)."""
    folder = launch_folder()
    return folder is not None and any(p.name != f"rank{_rank()}.error" for p in folder.glob("rank*.error"))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
