"""A picture of the simulated step (`launch/run.py --dry-run --trace FILE`): each simulated
rank role's step as a Chrome trace (JSON that ui.perfetto.dev and chrome://tracing open).

The order comes from the simulation: the step log (record.StepLog) holds each collective
as the rank issued it and, between them, the FLOPs of the matmuls and attention kernels
it ran. The times come from the step model of estimate.py, so that the picture and the
printed report tell the same story:

- compute: each stretch of FLOPs takes its share of the role's counted FLOPs times the
  estimate's `compute_s`, so a role's compute spans add up to `compute_s`;
- a collective takes `collective_seconds` over the link that `group_link` picks, and a
  point-to-point message `message_seconds`;
- the collectives the estimate puts on the critical path (tensor and context parallel,
  the pipeline group's, such as a tied weight's gradient, and every optimizer-phase one)
  sit on the compute track, which waits for them;
- FSDP's forward and backward collectives, which the estimate hides under compute, run
  on a track of their own, each starting when it was issued, after the one before it;
  the pipeline's sends and receives likewise, each direction on its own track;
- under pipeline parallel, the schedule's bubble is split into a fill before the rank's
  first compute and a drain after its last, a third and two thirds, as a forward and a
  backward (twice as long) share a micro-batch's time; the messages that the fill and the
  drain wait for (`exposed_p2p_s`) sit beside them, half each;
- the estimate charges FSDP's and the pipeline's traffic only where together it exceeds
  the compute time: that excess is one "exposed" span after the drain, before the
  optimizer's collectives. A queue that would still run past that span (traffic issued
  late in the backward, or more of it than fits after its issue) is moved earlier, last
  collective first, as if issued sooner: the estimate assumes the traffic hides anywhere
  under compute. Such a collective's `issued_us` says when the rank issued it.

So each role's trace ends at its own estimate's `step_s`; the printed step is the
slowest role's, which paces the pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UserError
from engine.dryrun.estimate import collective_seconds, device_profile, group_link, message_seconds, step_place
from engine.dryrun.record import POINT_TO_POINT, Compute

FORWARD_SHARE = 1 / 3  # a forward's share of a micro-batch's compute, its backward taking twice as long
COMPUTE, FSDP, SENDS, RECEIVES = "compute", "FSDP (overlaps compute)", "pp send", "pp recv"
TRACKS = (COMPUTE, FSDP, SENDS, RECEIVES)


@dataclass
class Span:
    track: str
    name: str
    category: str
    start: float  # seconds from the start of the step
    seconds: float
    args: dict = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass
class Queue:
    """Spans that run one after another on their own track, each from when it was issued,
    ending by a deadline (settle)."""
    spans: list[Span] = field(default_factory=list)
    issued: list[float] = field(default_factory=list)

    def add(self, span: Span) -> None:
        self.issued.append(span.start)
        if self.spans:
            span.start = max(span.start, self.spans[-1].end)
        self.spans.append(span)

    def settle(self, deadline: float) -> None:
        """Move the spans that would end after `deadline`, or run into a span so moved,
        earlier, last first."""
        for span, issued in zip(reversed(self.spans), reversed(self.issued)):
            span.start = min(span.start, deadline - span.seconds)
            if span.start < issued:
                span.args["issued_us"] = issued * 1e6
            deadline = span.start


def lay_out(log, estimate, spec, profile) -> list[Span]:
    """One role's step, from its step log and its estimate (this module's docstring)."""
    events = log.events
    total_flops = sum(event.flops for event in events if isinstance(event, Compute))
    if not total_flops:
        raise UserError("--trace found no matmul or attention in the simulated step, so it has nothing to spread "
                        "the compute time over: the model's FLOPs run in ops the trace does not count "
                        "(engine/dryrun/record.py, _flop_counts). Leave out --trace for this model.")
    first_update = next((i for i, event in enumerate(events) if event.phase == "optimizer"), len(events))
    spans: list[Span] = []
    queues = {track: Queue() for track in TRACKS[1:]}
    now = 0.0

    def on_compute_track(name: str, category: str, seconds: float, **args) -> None:
        nonlocal now
        if seconds > 0:
            spans.append(Span(COMPUTE, name, category, now, seconds, args))
            now += seconds

    def run(event) -> None:
        if isinstance(event, Compute):
            on_compute_track(event.phase, "compute", event.flops / total_flops * estimate.compute_s,
                             flops=event.flops)
            return
        ranks, bandwidth = group_link(event.dim, spec, profile)
        name, args = f"{event.kind} {event.dim}", {"bytes": event.bytes, "phase": event.phase, "ranks": ranks}
        if event.kind in POINT_TO_POINT:
            track = SENDS if event.kind == "send" else RECEIVES
            queues[track].add(Span(track, name, "p2p", now, message_seconds(event.bytes, bandwidth), args))
            return
        seconds = collective_seconds(event.kind, event.bytes, ranks, bandwidth)
        place = step_place(event.dim, event.phase)
        if place == "exposed":
            on_compute_track(name, "collective", seconds, **args)
        else:
            queues[FSDP].add(Span(FSDP, name, "collective", now, seconds, args))

    fill = estimate.bubble_s * FORWARD_SHARE
    on_compute_track("bubble (fill)", "bubble", fill, fraction_of_compute=estimate.bubble_fraction * FORWARD_SHARE)
    on_compute_track("waiting on P2P (fill)", "exposed", estimate.exposed_p2p_s / 2)
    for event in events[:first_update]:
        run(event)
    on_compute_track("waiting on P2P (drain)", "exposed", estimate.exposed_p2p_s / 2)
    on_compute_track("bubble (drain)", "bubble", estimate.bubble_s - fill,
                     fraction_of_compute=estimate.bubble_fraction * (1 - FORWARD_SHARE))
    overlapped = sum(span.seconds for span in queues[FSDP].spans)
    overlapped += max(sum(span.seconds for span in queues[track].spans) for track in (SENDS, RECEIVES))
    on_compute_track("exposed FSDP and pipeline traffic", "exposed", overlapped - estimate.compute_s,
                     overlapped_s=overlapped, compute_s=estimate.compute_s)
    for track in (FSDP, SENDS, RECEIVES):
        queues[track].settle(now)
    for event in events[first_update:]:
        run(event)
    return spans + [span for queue in queues.values() for span in queue.spans]


def role_steps(result) -> list[tuple[str, object, object]]:
    """(name, observation, estimate) of each simulated role: rank 0 without pipeline
    parallel, each stage role with it."""
    if not result.stage_roles:
        return [("rank 0", result.observed, result.estimate)]
    return [(f"pp rank {role.pp_rank} (stage{'s' * (len(role.stages) > 1)} {', '.join(map(str, role.stages))})",
             role.observed, role.estimate) for role in result.stage_roles]


def chrome_trace(roles: list[tuple[str, list[Span]]]) -> dict:
    """Complete ("X") events in microseconds, one process per role and one thread per
    track, named by metadata ("M") events."""
    events = []
    for pid, (role, spans) in enumerate(roles, 1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": role}})
        used = [track for track in TRACKS if any(span.track == track for span in spans)]
        for tid, track in enumerate(used, 1):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
            events += [{"ph": "X", "name": span.name, "cat": span.category, "pid": pid, "tid": tid,
                        "ts": span.start * 1e6, "dur": span.seconds * 1e6, "args": span.args}
                       for span in sorted(spans, key=lambda span: span.start) if span.track == track]
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_trace(result, cfg, spec, path: str) -> None:
    """The dry run's simulated step of each role, as a Chrome trace at `path`."""
    profile = device_profile(cfg.dryrun)
    roles = []
    for name, observed, estimate in role_steps(result):
        roles.append((name, lay_out(observed.step_log, estimate, spec, profile)))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(chrome_trace(roles)) + "\n")
