"""`torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS` for the suite's worker
scripts, with the ranks forked from a fork server, as `python launch/run.py` starts the
ranks of a CPU run (launch/run.py: launch_under_torchrun): torch and the engine are
imported once, not once per rank.

usage: python tests/forked_torchrun.py NPROC SCRIPT [ARGS]

A worker script leaves through parallel.process_group.exit_without_teardown. A forked
rank must instead return to torchrun's agent when it succeeds (the agent waits for each
rank's return value), so here that function returns on code 0 and exits on any other.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.exits import prepare_forked_rank, run_agent  # noqa: E402
from parallel import process_group  # noqa: E402


class Finished(BaseException):
    """The script left with code 0."""


def leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    raise Finished


# The script each rank runs: the fork server's ranks get the agent's environment.
SCRIPT = "FORKED_TORCHRUN_SCRIPT"


def run_script(argv: list[str]) -> int:
    script = os.environ[SCRIPT]
    prepare_forked_rank()
    process_group.exit_without_teardown = leave  # before the script imports it
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except Finished:
        pass
    return 0


if __name__ == "__main__":
    nproc, script, *args = sys.argv[1:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[SCRIPT] = script
    code = run_agent(["--standalone", f"--nproc_per_node={nproc}", script, *args], run_script,
                     ("engine.train", "launch.parity"))
    process_group.exit_without_teardown(code)
