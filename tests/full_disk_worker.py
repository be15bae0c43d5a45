"""Run under torchrun by tests/test_checkpoint.py: launch/run.py on a disk that fills up.

usage: torchrun --nproc_per_node N tests/full_disk_worker.py FAIL_STEP [launch/run.py arguments]

On rank 1, writing the checkpoint of step FAIL_STEP raises ENOSPC, as a full disk would.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.distributed.checkpoint.filesystem import FileSystemWriter  # noqa: E402

from engine.checkpoint.store import step_name  # noqa: E402
from launch.run import main  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402


def fill_disk_at(step: int) -> None:
    write_data = FileSystemWriter.write_data

    def failing_write_data(self, plan, planner):
        if step_name(step) in str(self.path) and os.environ["RANK"] == "1":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = failing_write_data


if __name__ == "__main__":
    fill_disk_at(int(sys.argv[1]))
    exit_without_teardown(main(sys.argv[2:]))
