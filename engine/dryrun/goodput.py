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

The report also gives the replica groups' goodput for each way of splitting the layout's
data ranks (hsdp x dp) into groups, at the layout's step time: what a user weighing a
split wants first, without a dry run per split. A split's own step and peak (each group
shards FSDP over fewer ranks) are its own dry run's.
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
    # (groups, goodput, seconds lost per failure) for each split of the data ranks (group_counts)
    splits: list[tuple[int, float, float]]

    def as_dict(self) -> dict:
        return dict(vars(self))


def group_counts(data_ranks: int) -> list[int]:
    """The replica-group counts shown for `data_ranks` (hsdp x dp): each power of two above 1
    that divides them, and all of them (one data rank per group)."""
    counts = [2 ** k for k in range(1, data_ranks.bit_length()) if data_ranks % 2 ** k == 0]
    return counts + [data_ranks] if data_ranks > 1 and data_ranks not in counts else counts


def goodput(world_size: int, groups: int, step_s: float, dryrun, data_ranks: int | None = None) -> Goodput:
    """With `data_ranks` (hsdp x dp), also the goodput of each split of them into groups."""
    per_second = dryrun.gpu_failures_per_day * world_size / 86400
    restart_lost = dryrun.restart_s + dryrun.checkpoint_interval_s / 2

    def share(lost_s: float) -> float:
        return 1 / (1 + per_second * lost_s)

    def group_lost(count: int) -> float:
        return step_s + HEARTBEAT_S + dryrun.restart_s / count

    splits = [(count, share(group_lost(count)), group_lost(count)) for count in group_counts(data_ranks or 1)]
    ft_lost = group_lost(groups) if groups > 1 else None
    return Goodput(failures_per_hour=per_second * 3600, restart=share(restart_lost),
                   fault_tolerant=share(ft_lost) if ft_lost is not None else None,
                   groups=groups, restart_lost_s=restart_lost, fault_tolerant_lost_s=ft_lost, splits=splits)


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
    if value.splits:
        lines.append(f"  the {value.splits[-1][0]} data ranks (hsdp x dp) split into fault-tolerant replica groups, "
                     f"at this step time (a split's own step and peak: its dry run):")
        lines += [f"    hsdp={count}: {share:.1%} ({lost:.1f} s of the job lost per failure)"
                  for count, share, lost in value.splits]
    return lines
