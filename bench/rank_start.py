"""Start-up of a CPU run: `python launch/run.py`, whose agent has its ranks forked by a
fork server (torch and the engine imported once more, not once per rank), against the
same run under the user's own torchrun, which spawns each rank in a new interpreter.

usage: python bench/rank_start.py [PAIRS, default 5] [launch/run.py arguments]
   e.g. .venv/bin/python bench/rank_start.py 5 --mesh dp=4,tp=2 --set training.steps=2

The two commands alternate, which goes first alternating too, so a drift in the
machine's load hits both alike. Each is timed as a whole, with the CPU time of all its
processes, from the kernel's accounting: this process is their subreaper, so the fork
server, which outlives the launcher by a moment, is counted with its ranks. Prints
the median wall and CPU seconds of each and the median of the per-pair ratios.
"""

from __future__ import annotations

import ctypes
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of `command`, which must exit 0."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    while True:  # the orphans this process adopted: their CPU time counts once reaped
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        sys.exit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(pairs: int, arguments: list[str]) -> None:
    from parallel.mesh import parse_mesh
    mesh = arguments[arguments.index("--mesh") + 1] if "--mesh" in arguments else "dp=4,tp=2"
    nproc = parse_mesh(mesh).world_size
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        run = [*arguments, "--set", f"run.dir={scratch}"]
        forked = [sys.executable, str(REPO / "launch" / "run.py"), *run]
        spawned = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(REPO / "launch" / "run.py"), *run]
        timed(forked, env)  # warm-up: the file system's caches
        samples = {"forked": [], "spawned": []}
        for pair in range(pairs):
            order = [("forked", forked), ("spawned", spawned)]
            for name, command in order if pair % 2 == 0 else order[::-1]:
                samples[name].append(timed(command, env))
    print(f"{' '.join(arguments)} ({nproc} ranks, {pairs} pairs, OMP_NUM_THREADS=1)")
    print("| launch | wall s (median) | CPU s (median) |")
    print("|---|---|---|")
    for name, label in (("spawned", "torchrun (spawned ranks)"), ("forked", "python launch/run.py (ranks from a fork server)")):
        walls, cpus = zip(*samples[name])
        print(f"| {label} | {statistics.median(walls):.2f} | {statistics.median(cpus):.2f} |")
    pairs_of = list(zip(samples["forked"], samples["spawned"]))
    wall, cpu = (statistics.median(f[i] / s[i] for f, s in pairs_of) for i in (0, 1))
    print(f"forked / spawned, median of the pairs: wall {wall:.2f}, CPU {cpu:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("this needs Linux: prctl(PR_SET_CHILD_SUBREAPER) failed")
    counted = len(sys.argv) > 1 and sys.argv[1].isdigit()
    main(int(sys.argv[1]) if counted else 5, sys.argv[2:] if counted else sys.argv[1:])
