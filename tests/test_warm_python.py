"""The test session's warm python (tests/warm_python.py) behaves as a fresh interpreter would: arguments, working
directory, environment, standard streams and exit status pass through; a killed caller ends its run; an environment
the server cannot serve runs cold."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.warm_python import COLD, python_command

SCRIPT = """import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0], "env", os.environ.get("WARM_PROBE"))
print("stdin", sys.stdin.read().strip(), "pid", os.getpid(), "ppid", os.getppid())
print("to stderr", file=sys.stderr)
if sys.argv[1:2] == ["sleep"]:
    open(sys.argv[2], "w").write(str(os.getpid()))
    import time; time.sleep(600)
sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def warm() -> list[str]:
    command = python_command()
    if command == [sys.executable]:
        pytest.skip("the session's warm python is switched off (TITAN_LITE_TEST_WARM=0)")
    return command


def run(command: list[str], script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*command, str(script), *args], cwd=script.parent, input="from stdin", capture_output=True,
                          text=True, env={**os.environ, "WARM_PROBE": "probe", **(env or {})}, timeout=60)


def test_a_script_sees_what_a_fresh_python_gives_it(warm, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    got, cold = run(warm, script, "3", "x y"), run([sys.executable], script, "3", "x y")
    assert (got.returncode, got.stderr) == (cold.returncode, cold.stderr) == (3, "to stderr\n")
    first = f"argv ['3', 'x y'] cwd {tmp_path} path0 {tmp_path} env probe"
    assert got.stdout.splitlines()[0] == cold.stdout.splitlines()[0] == first
    assert got.stdout.splitlines()[1].startswith("stdin from stdin pid ")
    assert int(got.stdout.split("ppid ")[1]) != os.getpid()  # warm: the server's child, not this process's


def test_a_killed_caller_ends_its_run(warm, tmp_path):
    script, pid_file = tmp_path / "probe.py", tmp_path / "pid"
    script.write_text(SCRIPT)
    caller = subprocess.Popen([*warm, str(script), "sleep", str(pid_file)], cwd=tmp_path, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and caller.poll() is None
        time.sleep(0.05)
    run_pid = int(pid_file.read_text())
    assert run_pid != caller.pid  # the run is the server's child, not the caller itself
    os.killpg(caller.pid, signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{run_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{run_pid}").exists()


@pytest.mark.parametrize("env", [{"OMP_NUM_THREADS": "2"}, COLD])
def test_an_environment_the_server_cannot_serve_runs_cold(warm, tmp_path, env):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    caller = subprocess.run([*warm, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, **env}, input="")
    ppid = int(caller.stdout.split("ppid ")[1].split()[0])
    # cold: the caller execs the real interpreter, so the script runs in the caller's own process
    assert caller.returncode == 0 and ppid == os.getpid(), caller.stdout
