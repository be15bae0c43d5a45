"""Run under torchrun by tests/test_multinode.py: launch/run.py, where one rank is
SIGKILLed right after a given step of the first attempt.

usage: torchrun ... tests/killed_rank_worker.py RANK STEP MARKER [launch/run.py arguments]

The rank kills itself, so the kill lands at that step however slow the machine is (a kill
sent from outside, timed by reading the run's progress, can land after the other node's
ranks have finished: torchrun cannot restart that job). MARKER records the kill, so the
restarted attempt runs to the end.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.checkpoint.dcp import Checkpointer  # noqa: E402
from launch.run import main  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402


def kill_after(rank: int, step: int, marker: Path) -> None:
    step_finished = Checkpointer.step_finished

    def finished_then_killed(self, index: int) -> None:
        step_finished(self, index)
        if index + 1 == step and int(os.environ["RANK"]) == rank and not marker.exists():
            marker.write_text(f"rank {rank} killed after step {step}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    Checkpointer.step_finished = finished_then_killed


if __name__ == "__main__":
    kill_after(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    exit_without_teardown(main(sys.argv[4:]))
