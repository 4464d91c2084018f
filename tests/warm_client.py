"""The `python` that run_train.sh finds in the test session's warm environment (tests/warm_python.py).

`warm_client.py REAL_PYTHON SOCKET ARGS...`: `-m MODULE ...` and `SCRIPT.py ...` are run by the session's warm
server (a process that has imported torch and titan_lite once) as a child forked for this call, with this process's
arguments, environment, working directory and standard streams; anything else (`-c CODE`, interpreter options), or a
server that is not there or cannot serve this environment, runs REAL_PYTHON itself. This process stands in for the
run: its exit status is the run's, a stop signal sent to it goes to the run, and when it is killed the server kills
the run.
Runs with `python -IS`: the standard library only.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def run_cold(real: str, args: list[str]) -> None:
    os.execv(real, [real, *args])


def main() -> None:
    real, path, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if not (args[:1] == ["-m"] and len(args) > 1 or args[:1] and args[0].endswith(".py")):
        run_cold(real, args)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        server.connect(path)
        request = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(server, [request], [0, 1, 2])
        answer = server.recv(64).decode().split()
    except OSError:
        answer = []
    if answer[:1] != ["pid"]:
        server.close()
        run_cold(real, args)  # no server yet, or an environment it cannot serve
    pid = int(answer[1])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    reply = b""
    while not reply.startswith(b"exit"):
        reply = server.recv(64)
        if not reply:
            sys.exit("warm_client: the warm server went away during the run")
    status = int(reply.split()[1])
    if status < 0:  # killed by a signal: end the same way
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main()
