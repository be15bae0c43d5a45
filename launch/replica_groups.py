"""Fault-tolerant replica groups on one machine, from one command (docs/fault_tolerance.md).

`python launch/run.py --mesh hsdp=2,dp=2 --set fault_tolerance.enabled=true`, with no
Lighthouse address, starts a torchft Lighthouse and one job per replica group (each
`launch/run.py` again, with its group's number), and supervises them: a group that
fails is started again with fault_tolerance.rejoin=true, up to --max-restarts times
(3 when not given), and heals from the live groups; a Lighthouse that stops is started
again on its port, and the groups retry their quorum until it answers. Bad input (exit 2)
or a non-finite loss (exit 3, which every group sees alike) in any group stops them all.
On several nodes each group is its own job, and this supervision is the scheduler's
(docs/fault_tolerance.md, "On several nodes").
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.errors import EXIT_NONFINITE_LOSS, EXIT_OK, EXIT_USER_ERROR, UserError

RESTARTS = 3  # when --max-restarts is not given
# The Lighthouse's clocks: a group whose heartbeat stops for HEARTBEAT_MS is left out of the
# next quorum; a quorum waits at most JOIN_MS for groups that heartbeat but have not asked.
HEARTBEAT_MS, JOIN_MS, TICK_MS = 2000, 1000, 100
POLL_S = 0.2


def lighthouse_command(port: int, min_groups: int) -> list[str]:
    found = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    if not Path(found).exists():
        raise UserError("torchft's Lighthouse (torchft_lighthouse) is not installed beside this Python. Install "
                        "torchft with `pip install -e .[ft]`.")
    # A quorum of fewer than min_groups could not commit: the Lighthouse waits for them instead.
    return [found, "--min_replicas", str(min_groups), "--bind", f"[::]:{port}", "--heartbeat_timeout_ms", str(HEARTBEAT_MS),
            "--join_timeout_ms", str(JOIN_MS), "--quorum_tick_ms", str(TICK_MS)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the torchft Lighthouse exited with code {process.returncode} as it started")
        try:
            with socket.create_connection(("localhost", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the torchft Lighthouse did not listen on port {port} within {seconds:.0f} s")


def without_restarts(argv: list[str]) -> list[str]:
    """The command line each group gets: --max-restarts is the supervisor's, not the groups'."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--max-restarts":
            skip = True
        elif not item.startswith("--max-restarts="):
            kept.append(item)
    return kept


# How long the other groups of a --parity check may take to finish their reports once one
# group has stopped (a FAIL stops every group, each after writing its report)
REPORT_GRACE_S = 120


def run_replica_groups(script: Path, argv: list[str], groups: int, ranks_per_group: int, min_groups: int,
                       run_dir: str, max_restarts: int | None, grace_s: float = 0) -> int:
    """The Lighthouse and `groups` jobs of `script argv`; returns 0 when every group finished,
    else the code of the group that stopped them, after `grace_s` for the others to stop
    on their own."""
    restarts_left = RESTARTS if max_restarts is None else max_restarts
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    port = free_port()
    lighthouse_log = open(Path(run_dir) / "lighthouse.log", "w")

    def start_lighthouse() -> subprocess.Popen:
        return subprocess.Popen(lighthouse_command(port, min_groups), stdout=lighthouse_log, stderr=subprocess.STDOUT)

    lighthouse = start_lighthouse()
    address = f"http://localhost:{port}"
    env = dict(os.environ)
    # The groups share this machine's cores: one thread per rank unless the user chose.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (groups * ranks_per_group))))
    running: dict[int, subprocess.Popen] = {}

    def start(group: int, rejoin: bool) -> None:
        settings = [f"fault_tolerance.group={group}", f"fault_tolerance.lighthouse={address}",
                    f"fault_tolerance.rejoin={'true' if rejoin else 'false'}"]
        running[group] = subprocess.Popen([sys.executable, str(script), *argv,
                                           *(item for s in settings for item in ("--set", s))], env=env)

    code = EXIT_OK
    try:
        wait_for_port(port, lighthouse)
        print(f"[replica groups] torchft Lighthouse at {address}; starting {groups} replica groups of "
              f"{ranks_per_group} rank(s)", flush=True)
        for group in range(groups):
            start(group, rejoin=False)
        while running:
            time.sleep(POLL_S)
            if lighthouse.poll() is not None:
                # The groups retry their quorum (fault_tolerance.quorum_retries) while it is down.
                print(f"[replica groups] the Lighthouse stopped with code {lighthouse.returncode}; starting it "
                      f"again on port {port}", flush=True)
                lighthouse = start_lighthouse()
            for group, process in list(running.items()):
                status = process.poll()
                if status is None:
                    continue
                del running[group]
                if status == EXIT_OK:
                    print(f"[replica groups] group {group} finished", flush=True)
                elif status not in (EXIT_USER_ERROR, EXIT_NONFINITE_LOSS) and restarts_left > 0:
                    restarts_left -= 1
                    print(f"[replica groups] group {group} stopped with code {status}; starting it again to "
                          f"heal from the live groups ({restarts_left} restart(s) left)", flush=True)
                    start(group, rejoin=True)
                else:
                    print(f"[replica groups] group {group} stopped with code {status}; stopping the others",
                          flush=True)
                    code = status
                    stop(running, grace_s)
                    break
    finally:
        stop(running)
        lighthouse.terminate()
        lighthouse.wait()
        lighthouse_log.close()
    return code


def stop(running: dict[int, subprocess.Popen], grace_s: float = 0) -> None:
    """SIGTERM to each group's launcher, whose torchrun agent stops its ranks; first, up to
    `grace_s` for them to stop on their own."""
    deadline = time.monotonic() + grace_s
    while any(process.poll() is None for process in running.values()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for process in running.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in running.values():
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    running.clear()
