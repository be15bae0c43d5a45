"""Runs `python launch/run.py ARGS` for tests/distributed.py: launcher, without a new
interpreter each time. This process imports torch and the engine once, then for each
request forks a child that runs launch/run.py as `__main__` with the request's
arguments, environment and working folder, its output in the request's files. The child
is what `python launch/run.py` would be after its imports; on 2 cores those imports are
seconds of each of the suite's many launches.

Requests come on stdin, one JSON object a line: {"argv", "env", "cwd", "stdout",
"stderr", "timeout"}; each answer is one line on stdout: {"code"} (a negative code: the
signal that ended the child) or {"timed_out": true}. The server runs one child at a time
and stays single-threaded, so that forking it is safe; it ends when stdin closes.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import engine.dryrun.search  # noqa: E402,F401  (what the launcher imports, once for all launches)
import engine.dryrun.simulate  # noqa: E402,F401
import launch.run  # noqa: E402,F401

RUN = str(REPO / "launch" / "run.py")


def child(request: dict) -> None:
    """Become `python launch/run.py ARGS` with the request's surroundings; never returns."""
    try:
        os.setsid()  # its own process group: a timeout ends it and the ranks it started
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        sys.argv = [RUN, *request["argv"]]
        runpy.run_path(RUN, run_name="__main__")  # leaves through os._exit with the run's code
    except SystemExit as stop:  # argparse's usage errors, --help
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(stop.code if isinstance(stop.code, int) else 1)
    except BaseException:  # noqa: BLE001 -- as an interpreter would: the traceback, code 1
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def serve(request: dict) -> dict:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        child(request)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"code": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timed_out": True}
        time.sleep(0.02)


if __name__ == "__main__":
    for line in sys.stdin:
        print(json.dumps(serve(json.loads(line))), flush=True)
