"""Expected goodput under failures: the share of wall time that trains, for a whole-job
restart from the last checkpoint against fault-tolerant replica groups (docs/planning.md,
"Goodput under failures"; docs/fault_tolerance.md).

First order in the failure rate (a failure's cost is small beside the time between
failures, as at Meta's rate): with F failures per second over the job, and L seconds of
the whole job's work lost to each, goodput is 1 / (1 + F L).

- Whole-job restart: every rank stops, restarts (dryrun.restart_s) and recomputes the
  steps since the last checkpoint, on average half an interval (dryrun.checkpoint_interval_s).
- Fault-tolerant replica groups (hsdp > 1): the step in flight is lost on every group, the
  survivors wait for the Lighthouse to drop the failed group (HEARTBEAT_S), then train on;
  the failed group is away for a restart (the same dryrun.restart_s) and its share, 1/hsdp
  of the job, is what the job lacks meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

HEARTBEAT_S = 2.0  # launch/replica_groups.py: the Lighthouse's heartbeat timeout


@dataclass
class Goodput:
    failures_per_hour: float  # over the whole job
    restart: float  # whole-job restart from the last checkpoint
    fault_tolerant: float | None  # replica groups; None without hsdp
    groups: int
    restart_lost_s: float  # work lost per failure
    fault_tolerant_lost_s: float | None

    def as_dict(self) -> dict:
        return dict(vars(self))


def goodput(world_size: int, groups: int, step_s: float, dryrun) -> Goodput:
    per_second = dryrun.gpu_failures_per_day * world_size / 86400
    restart_lost = dryrun.restart_s + dryrun.checkpoint_interval_s / 2
    ft_lost = step_s + HEARTBEAT_S + dryrun.restart_s / groups if groups > 1 else None
    return Goodput(failures_per_hour=per_second * 3600, restart=1 / (1 + per_second * restart_lost),
                   fault_tolerant=1 / (1 + per_second * ft_lost) if ft_lost is not None else None,
                   groups=groups, restart_lost_s=restart_lost, fault_tolerant_lost_s=ft_lost)


def render(value: Goodput, dryrun) -> list[str]:
    lines = ["", f"goodput under failures ({dryrun.gpu_failures_per_day:.3g} per GPU per day: "
                 f"{value.failures_per_hour:.3g} per hour over the job; restart {dryrun.restart_s:.0f} s, "
                 f"checkpoint every {dryrun.checkpoint_interval_s:.0f} s)",
             f"  whole-job restart from the last checkpoint: {value.restart:.1%} "
             f"({value.restart_lost_s:.0f} s of the job lost per failure)"]
    if value.fault_tolerant is None:
        lines.append("  fault-tolerant replica groups: none in this mesh (they are hsdp's groups; "
                     "docs/fault_tolerance.md)")
    else:
        lines.append(f"  fault-tolerant replica groups (hsdp={value.groups}): {value.fault_tolerant:.1%} "
                     f"({value.fault_tolerant_lost_s:.1f} s of the job lost per failure)")
    return lines
