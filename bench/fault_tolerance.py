"""Fault-tolerant replica groups, measured (docs/fault_tolerance.md).

usage: python bench/fault_tolerance.py drill [RUNS, default 10]
       python bench/fault_tolerance.py overhead [PAIRS, default 3]

`drill` runs the kill-and-rejoin drill RUNS times while two busy processes per core load
the machine: `python launch/run.py --mesh hsdp=2,dp=2 --set fault_tolerance.enabled=true`
(150 steps of the debug model, fingerprints on), a rank of group 1 SIGKILLed once its group
has committed 10 steps. Each run passes when the supervisor exits 0, each group's committed
batches are each batch once, the survivors committed steps alone, and the rejoined group's
weight fingerprints equal the survivors' at every step both committed. Prints one table row
per run: the seconds from the kill to the survivors' next committed step and to the first
step committed by both groups again, and the pass count.

`overhead` times PAIRS pairs of 40-step runs of the same mesh, plain hsdp and fault
tolerant, alternating which goes first; each run's median step time after its first 5
steps, and the ratio fault tolerant / plain per pair and their median.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.distributed import cpu_env  # noqa: E402

FT = ("--set", "fault_tolerance.enabled=true")


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def a_rank_of_group(supervisor: int, group: int) -> int | None:
    """A rank of replica group `group`: the supervisor's child whose command line names the
    group runs torchrun's agent, whose fork server's children are the ranks (launch/run.py)."""
    for launcher_pid in children(supervisor):
        if f"fault_tolerance.group={group}" in cmdline(launcher_pid):
            for server in children(launcher_pid):
                if "forkserver" in cmdline(server) and children(server):
                    return max(children(server))
    return None


def wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {seconds:.0f} s")


def the_lighthouse(supervisor: int) -> int | None:
    return next((pid for pid in children(supervisor) if "torchft_lighthouse" in cmdline(pid)), None)


def kill_and_rejoin(run_dir: Path, steps: int = 150, kill_after: int = 10, victim=None) -> dict:
    """Two replica groups of 2 ranks, started as a user starts them; a rank of group 1 (or
    `victim(supervisor pid)`'s pid) SIGKILLed once group 1 has committed `kill_after` steps;
    the supervisor starts it again. Returns the exit code, the kill's time, each group's
    records and the supervisor's output."""
    victim = victim or (lambda supervisor: a_rank_of_group(supervisor, 1))
    command = [sys.executable, str(REPO / "launch" / "run.py"), "--mesh", "hsdp=2,dp=2", *FT,
               "--set", "fault_tolerance.fingerprint=true", "--set", f"training.steps={steps}",
               "--set", f"run.dir={run_dir}"]
    log = run_dir.with_suffix(".log")
    with open(log, "w") as out:
        supervisor = subprocess.Popen(command, cwd=REPO, env=cpu_env(), stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            wait_for(lambda: sum(r["committed"] for r in records(run_dir / "group-1")) >= kill_after, 240,
                     f"group 1 committing {kill_after} steps")
            os.kill(wait_for(lambda: victim(supervisor.pid), 30, "finding the process to kill"), signal.SIGKILL)
            killed_at = time.time()
            code = supervisor.wait(timeout=600)
        finally:
            if supervisor.poll() is None:
                os.killpg(supervisor.pid, signal.SIGKILL)
    return {"code": code, "killed_at": killed_at, "groups": [records(run_dir / f"group-{g}") for g in (0, 1)],
            "log": log.read_text()}


def check_kill_and_rejoin(outcome: dict, steps: int) -> dict:
    """Asserts what must hold after kill_and_rejoin and returns the measured figures."""
    assert outcome["code"] == 0, outcome["log"][-4000:]
    assert "group 1 stopped with code" in outcome["log"] and "starting it again" in outcome["log"], \
        outcome["log"][-4000:]
    survivors, rejoined = outcome["groups"]
    # Each group's committed batches, by their index: every one once, as without a failure
    # (a batch's rows for a data rank are fixed by its index: engine/data/sources.py).
    for group in outcome["groups"]:
        assert sorted(r["step"] for r in group if r["committed"]) == list(range(steps))
    after_kill = [r for r in survivors if r["time"] > outcome["killed_at"]]
    alone = [r for r in after_kill if r["committed"] and r["groups"] == 1]
    assert alone, "the surviving group never committed a step alone"
    went_on = alone[0]
    back = [r for r in rejoined if r["time"] > outcome["killed_at"]]
    healed = next(r for r in back if r["committed"] and r["groups"] == 2)
    # After the rejoin the groups' weights are equal at every step both committed together.
    by_step = {r["replica_step"]: r["fingerprint"] for r in survivors if r["committed"] and r["groups"] == 2}
    together = [r for r in back if r["committed"] and r["groups"] == 2 and r["replica_step"] in by_step]
    assert together, "no step after the rejoin was committed by both groups"
    assert all(by_step[r["replica_step"]] == r["fingerprint"] for r in together)
    return {"survivors_went_on_s": went_on["time"] - outcome["killed_at"],
            "rejoined_s": healed["time"] - outcome["killed_at"],
            "uncommitted": sum(not r["committed"] for r in survivors),
            "alone": len(alone), "together_after_rejoin": len(together),
            "fingerprint": together[-1]["fingerprint"]}


def check_lighthouse_restart(outcome: dict, steps: int) -> int:
    """Asserts what must hold after kill_and_rejoin(victim=the_lighthouse); returns how many
    steps both groups committed together after the kill."""
    assert outcome["code"] == 0, outcome["log"][-4000:]
    assert "the Lighthouse stopped" in outcome["log"], outcome["log"][-4000:]
    for group in outcome["groups"]:
        assert sorted(r["step"] for r in group if r["committed"]) == list(range(steps))
    together = [r for r in outcome["groups"][0]
                if r["time"] > outcome["killed_at"] and r["committed"] and r["groups"] == 2]
    assert together, "the groups did not commit a step together after the Lighthouse restarted"
    return len(together)


def drill(runs: int) -> None:
    from tests.test_multinode import cpu_load
    print("| run | survivors went on, s | both groups again, s | uncommitted steps | steps alone | result |")
    print("|---|---|---|---|---|---|")
    passed = 0
    with cpu_load(seconds=runs * 240):
        for run in range(runs):
            with tempfile.TemporaryDirectory() as scratch:
                try:
                    figures = check_kill_and_rejoin(kill_and_rejoin(Path(scratch) / "run"), 150)
                except AssertionError as err:
                    print(f"| {run + 1} | | | | | FAIL: {str(err).splitlines()[0][:120]} |", flush=True)
                    continue
            passed += 1
            print(f"| {run + 1} | {figures['survivors_went_on_s']:.1f} | {figures['rejoined_s']:.1f} | "
                  f"{figures['uncommitted']} | {figures['alone']} | pass |", flush=True)
    print(f"{passed} of {runs} passed")


def median_step(run_dir: Path) -> float:
    steps = [r["step_s"] for r in records(run_dir) if r.get("committed", True)]
    return statistics.median(steps[5:])


def overhead(pairs: int) -> None:
    common = [sys.executable, str(REPO / "launch" / "run.py"), "--mesh", "hsdp=2,dp=2", "--set", "training.steps=40"]
    ratios = []
    for pair in range(pairs):
        with tempfile.TemporaryDirectory() as scratch:
            times = {}
            order = ("plain", "ft") if pair % 2 == 0 else ("ft", "plain")
            for kind in order:
                extra = [*FT, "--set", "fault_tolerance.min_groups=2"] if kind == "ft" else []
                run_dir = Path(scratch) / kind
                subprocess.run([*common, *extra, "--set", f"run.dir={run_dir}"], cwd=REPO, env=cpu_env(),
                               check=True, capture_output=True)
                times[kind] = median_step(run_dir / "group-0" if kind == "ft" else run_dir)
            ratios.append(times["ft"] / times["plain"])
            print(f"pair {pair + 1}: plain {times['plain'] * 1000:.1f} ms, fault tolerant {times['ft'] * 1000:.1f} ms,"
                  f" ratio {ratios[-1]:.3f}", flush=True)
    print(f"median ratio fault tolerant / plain over {pairs} pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "drill"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else (10 if what == "drill" else 3)
    {"drill": drill, "overhead": overhead}[what](count)
