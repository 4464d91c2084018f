"""run_train.sh's supervisor of torchrun: stop signals reach the ranks once, a rank's error ends the run in one line.

`python -m titan_lite.launcher <torchrun arguments>` runs torchrun as a child and speaks a small protocol with the
ranks of this node through a folder it creates for the launch (TITAN_LITE_LAUNCH_DIR):

- rank{R}.pid    written by each rank when it starts. SIGTERM and SIGINT sent to the launcher go straight to these
                 processes (the trainer stops at the next step boundary after saving a checkpoint; a second signal
                 stops it at once); before any rank has started, they end the launch. torchrun itself ignores
                 SIGTERM and SIGINT: it would forward them and kill the ranks after 30 s, in the middle of a large
                 save. SIGHUP (a closed terminal) is left to torchrun, which shuts the ranks down.
- rank{R}.error  "<exit code>\\n<one line>" written by a rank that stops on a user error (2), a training fault (3)
                 or a hung collective (4), instead of printing it. The launcher prints the line of the lowest rank
                 once, holds back torchrun's own failure report and traceback, and exits with that code. Codes 2 and
                 3 cannot be fixed by restarting, so the launcher ends torchrun at once (no --max_restarts rounds).

Everything else passes through: the ranks' output (torchrun's `[rankN]:` lines) as it comes, torchrun's own lines
as well unless the run ends in one of the single-line outcomes above. This module imports no torch, so it costs
nothing at launch; the rank-side functions at the bottom are what the trainer calls.

`python -m titan_lite.launcher --single <python arguments>` (one process on one node, no restarts) starts the rank
itself instead of torchrun, with the same protocol and the same `[rank0]:` lines: torchrun's own start and shutdown
cost about 4 s per launch on a CPU and do nothing for a group of one.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
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
SINGLE_RANK_PREFIX = b"[rank0]:"


@dataclass
class RankError:
    rank: int
    code: int
    message: str


# ------------------------------------------------------------------------------------------ launcher side


class Launch:
    """One torchrun child, its launch folder, and what the launcher learned while it ran."""

    def __init__(self, torchrun_args: list[str], single: bool = False):
        self.folder = Path(tempfile.mkdtemp(prefix="titan_lite_launch_"))
        self.signals: list[int] = []
        self.held: list[bytes] = []  # torchrun's own stderr lines, printed at the end unless the run ends in one line
        self.ended_torchrun = False
        self.stopped_before_start = False
        self.single = single
        env = {**os.environ, LAUNCH_DIR_ENV: str(self.folder), STDOUT_IS_TTY_ENV: "1" if sys.stdout.isatty() else "0",
               "PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS}
        if single:
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
            env.pop("MASTER_ADDR", None)  # the rank picks a free local port for its group of one
        command = [sys.executable, *torchrun_args] if single else [sys.executable, "-m", "torch.distributed.run",
                                                                    *torchrun_args]
        # torchrun and its ranks start with SIGTERM/SIGINT ignored (the ranks install their own handlers).
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        self.proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE,
                                     stdout=subprocess.PIPE if single else None)
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
        """A stop signal: to every rank that has started; before any has, torchrun shuts the launch down."""
        self.signals.append(signum)
        pids = self.rank_pids()
        if not pids:
            self.stopped_before_start = True
            self.end_torchrun()
            return
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass  # that rank already exited

    def end_torchrun(self) -> None:
        if not self.ended_torchrun and self.proc.poll() is None:
            self.ended_torchrun = True
            self.proc.send_signal(signal.SIGHUP)

    def errors(self) -> list[RankError]:
        return sorted((e for e in map(read_error, self.folder.glob("rank*.error")) if e is not None),
                      key=lambda e: e.rank)

    def one_line_outcome(self) -> bool:
        """Whether the run ends with a single line of ours: an error a rank reported, a second signal, or a stop
        before any rank started."""
        return bool(self.errors()) or len(self.signals) >= 2 or self.stopped_before_start

    def watch_errors(self) -> None:
        """Background: end torchrun as soon as a rank reports an error that restarting cannot fix."""
        while self.proc.poll() is None:
            if any(e.code in NOT_RESTARTABLE for e in self.errors()):
                self.end_torchrun()
                return
            time.sleep(POLL_SECONDS)

    def relay_stderr(self) -> None:
        """Ranks' lines pass through at once; torchrun's own are held back once the run ends in one line."""
        out = sys.stderr.buffer
        for line in iter(self.proc.stderr.readline, b""):
            if self.single:
                line = SINGLE_RANK_PREFIX + line
            if line.startswith(b"[rank") or not self.one_line_outcome():
                out.write(line)
                out.flush()
            else:
                self.held.append(line)

    def relay_stdout(self) -> None:
        """The single rank's stdout, as torchrun would show it."""
        out = sys.stdout.buffer
        for line in iter(self.proc.stdout.readline, b""):
            out.write(SINGLE_RANK_PREFIX + line)
            out.flush()

    def wait(self) -> int:
        watcher = threading.Thread(target=self.watch_errors, daemon=True)
        watcher.start()
        stdout = threading.Thread(target=self.relay_stdout, daemon=True) if self.single else None
        if stdout is not None:
            stdout.start()
        self.relay_stderr()
        code = self.proc.wait()
        if stdout is not None:
            stdout.join()
        return self.outcome(code if code >= 0 else 128 - code)

    def outcome(self, torchrun_code: int) -> int:
        errors = self.errors()
        if torchrun_code == 0:
            self.print_held()
            return 0
        if self.stopped_before_start:
            name = signal.Signals(self.signals[0]).name
            print(f"stopped by {name} before any rank started: nothing to save", file=sys.stderr, flush=True)
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
        return torchrun_code

    def print_held(self) -> None:
        sys.stderr.buffer.write(b"".join(self.held))
        sys.stderr.flush()

    def cleanup(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def read_error(path: Path) -> RankError | None:
    try:
        code, message = path.read_text().split("\n", 1)
        return RankError(int(path.name.removeprefix("rank").removesuffix(".error")), int(code), message.strip())
    except (OSError, ValueError):
        return None  # being written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    single = bool(argv) and argv[0] == "--single"
    launch = Launch(argv[1:] if single else argv, single=single)
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
