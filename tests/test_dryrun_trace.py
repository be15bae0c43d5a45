"""`launch/run.py --dry-run --trace FILE`: the simulated step drawn as a Chrome trace
(engine/dryrun/trace.py). The dry runs here are the real thing at debug size: one process
simulates every rank role of the layout in torch's fake process group (the `fake`
backend: collectives return at once and move nothing) on fake tensors, so the order of
compute and collectives in the trace is the one the engine's own step runs."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tests.distributed import launcher

BATCH = "training.global_batch=8"
LAYOUTS = {
    # 1F1B over two stages, each with FSDP over dp and sequence-parallel tp.
    "pipeline": ("pp=2,dp=2,tp=2", [BATCH, "training.micro_batches=2", "parallel.sequence_parallel=true"]),
    # No pipeline: rank 0 alone; full AC repeats each block's forward inside the backward.
    "rank 0": ("dp=2,tp=2", [BATCH, "parallel.activation_checkpoint=full"]),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def traced(request, tmp_path_factory):
    """(the layout's name, the JSON report, the trace) of a traced dry run."""
    mesh, overrides = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp("trace")
    report, trace = out / "report.json", out / "trace.json"
    result = launcher("--dry-run", "--mesh", mesh, "--trace", str(trace), "--set", f"dryrun.report={report}",
                      *(arg for value in overrides for arg in ("--set", value)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trace -> {trace}" in result.stdout
    return request.param, json.loads(report.read_text()), json.loads(trace.read_text())


def by_role(trace: dict) -> dict[str, list[dict]]:
    """Each role's (process's) complete events, each with its track's name as `track`."""
    roles = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    spans = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            spans[roles[event["pid"]]].append({**event, "track": tracks[event["pid"], event["tid"]]})
    return dict(spans)


def test_each_role_adds_up_to_its_estimate(traced):
    """A role's compute spans take the estimate's compute time between them, and its
    step ends at the estimate's step time: the picture is the printed report's model."""
    layout, report, trace = traced
    spans = by_role(trace)
    if report["pipeline"]:
        estimates = {f"pp rank {r['pp_rank']} (stage {r['stages'][0]})": r["step"] for r in report["pipeline"]["roles"]}
    else:
        estimates = {"rank 0": report["step"]}
    assert set(spans) == set(estimates)
    for role, step in estimates.items():
        compute = sum(e["dur"] for e in spans[role] if e["cat"] == "compute") / 1e6
        end = max(e["ts"] + e["dur"] for e in spans[role]) / 1e6
        assert compute == pytest.approx(step["compute_s"], rel=1e-9), role
        assert end == pytest.approx(step["step_s"], rel=0.01), role
        names = {(e["track"], e["name"]) for e in spans[role]}
        assert any(track == "compute" and name.endswith(" tp") for track, name in names), role
        assert ("FSDP (overlaps compute)", "all_gather dp") in names, role
        assert {"forward", "backward"} <= {e["name"] for e in spans[role] if e["cat"] == "compute"}, role
        if layout == "pipeline":
            assert {"send pp", "recv pp"} <= {e["name"] for e in spans[role] if e["cat"] == "p2p"}, role
            bubble = sum(e["dur"] for e in spans[role] if e["cat"] == "bubble") / 1e6
            assert bubble == pytest.approx(step["bubble_s"], rel=1e-9) and bubble > 0, role


def test_every_event_has_what_perfetto_reads(traced):
    """Every event names its phase type, process, thread and name; complete events their
    start and duration in microseconds; each track is named, and its spans follow one
    another without overlapping (Perfetto drops slices that overlap without nesting)."""
    _, _, trace = traced
    events = trace["traceEvents"]
    assert events and all({"ph", "pid", "tid", "name"} <= set(e) for e in events)
    assert {e["ph"] for e in events} == {"X", "M"}
    assert all(e["name"] in ("process_name", "thread_name") and e["args"]["name"] for e in events if e["ph"] == "M")
    named = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    tracks = defaultdict(list)
    for event in (e for e in events if e["ph"] == "X"):
        assert all(isinstance(event[key], (int, float)) for key in ("ts", "dur")) and event["dur"] >= 0, event
        assert (event["pid"], event["tid"]) in named, event
        tracks[event["pid"], event["tid"]].append((event["ts"], event["ts"] + event["dur"]))
    for spans in tracks.values():
        spans.sort()
        assert all(end <= next_start * (1 + 1e-12) for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_late_fsdp_traffic_is_drawn_before_the_optimizer_as_the_estimate_hides_it():
    """A reduce-scatter issued at the end of the backward that the estimate hides under
    compute: the trace moves it earlier, to end by the optimizer's step, and says when it
    was issued."""
    from engine.dryrun.estimate import Profile, StepEstimate
    from engine.dryrun.record import StepLog
    from engine.dryrun.trace import lay_out
    from parallel.mesh import parse_mesh

    log = StepLog()
    log.compute("forward", 1)
    log.compute("backward", 3)
    log.collective("backward", "dp", "reduce_scatter", 2_000)  # 2 s over 2 ranks at 500 B/s
    log.collective("optimizer", "dp", "all_reduce", 1_000)  # 2 s, on the critical path
    estimate = StepEstimate(compute_s=4.0, comm_s={}, exposed_comm_s=2.0, step_s=6.0, tokens_per_s=1.0, mfu=0.1)
    profile = Profile("test", 1.0, 500.0, 500.0, 8, 1.0)
    spans = lay_out(log, estimate, parse_mesh("dp=2").resolve(2), profile)
    scatter = next(span for span in spans if span.name == "reduce_scatter dp")
    update = next(span for span in spans if span.name == "all_reduce dp")
    assert (scatter.start, scatter.end, scatter.args["issued_us"]) == (2.0, 4.0, 4e6)
    assert (update.track, update.start, update.end) == ("compute", 4.0, 6.0)
    assert [span.name for span in spans if span.category == "compute"] == ["forward", "backward"]


@pytest.mark.parametrize("args", [["--trace", "trace.json"], ["--plan-for", "--world", "4", "--trace", "trace.json"]])
def test_trace_without_dry_run_is_one_paragraph(args):
    result = launcher(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs --dry-run" in result.stderr and "Traceback" not in result.stderr, result.stderr
