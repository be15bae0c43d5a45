"""Several `launch/run.py --parity` runs in one torchrun job (tests/distributed.py,
`run_together`): the same ranks, one after another, so the suite pays for starting
processes, importing torch and joining gloo once per world size instead of once per
run. On 2 cores that start-up is most of a small parity run.

    torchrun --nproc_per_node N tests/shared_parity_worker.py CASES.json

CASES.json is a list of {"argv": [launch/run.py arguments], "done": PATH}. Each run
goes through the launcher's own checks (launch/run.py: check) and its parity run
(launch/parity.py: ParityRun), on a mesh of its own over the one default process group;
rank 0 writes PATH with the exit code once the run has returned. A run that raises
stops the whole job (its ranks may be inside a collective), and the cases without PATH
are run alone by the caller.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launch.parity import ParityRun  # noqa: E402
from launch.run import check, parse_args  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402


def main(cases_file: str) -> None:
    for case in json.loads(Path(cases_file).read_text()):
        try:
            cfg, spec = check(parse_args(case["argv"]), int(os.environ["WORLD_SIZE"]))
            code = ParityRun(cfg, spec).run()
            dist.barrier()
        except BaseException:  # noqa: BLE001 -- the other ranks may wait in a collective: end the job
            traceback.print_exc()
            exit_without_teardown(1)
        if dist.get_rank() == 0:
            Path(case["done"]).write_text(str(code))
        torch._dynamo.reset()  # a compiled run's graphs are specialised to its model's modules
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1])
