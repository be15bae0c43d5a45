"""The dry run's report: a table for the terminal and JSON for tools.

The JSON keys below are stable (docs/planning.md lists them); a change to their
meaning bumps `version`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.dryrun.estimate import device_profile, float8_speedup
from engine.dryrun.goodput import goodput, render as render_goodput

VERSION = 1
GIB = 1024 ** 3
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
EXTRA_KINDS = ("all_to_all",)  # a column where the step has them (expert parallel)


def as_dict(result, cfg) -> dict:
    e = result.estimate
    return {
        "version": VERSION,
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "mesh": result.mesh,
        "world_size": result.world_size,
        "seconds": result.seconds,
        "notes": result.notes,
        "roles": [{"ranks": r.ranks, "param_bytes": r.param_bytes, "grad_bytes": r.grad_bytes,
                   "optimizer_bytes": r.optimizer_bytes, "peak_bytes": r.peak_bytes} for r in result.roles],
        "rank0": result.observed.as_dict(),
        "comm": result.observed.comm,
        "flops_per_token": result.flops_per_token,
        "step": e.as_dict(),
        "device": dict(vars(cfg.dryrun)),
        "pipeline": pipeline_dict(result, cfg),
        "goodput": failure_goodput(result, cfg).as_dict(),
    }


def failure_goodput(result, cfg):
    from parallel.mesh import parse_mesh
    spec = parse_mesh(result.mesh)
    return goodput(result.world_size, spec.hsdp, result.estimate.step_s, cfg.dryrun, spec.hsdp * spec.dp)


def pipeline_dict(result, cfg) -> dict | None:
    """Each simulated stage role (pp > 1): its stages, blocks, memory, point-to-point
    traffic and step estimate; None without pipeline parallel."""
    if not result.stage_roles:
        return None
    p = cfg.parallel
    return {"schedule": p.pp_schedule, "stages_per_rank": p.pp_stages_per_rank,
            "micro_batches": cfg.training.micro_batches,
            "roles": [{"pp_rank": role.pp_rank, "stages": role.stages, "blocks": role.blocks,
                       "param_bytes": role.observed.param_bytes, "peak_bytes": role.observed.peak_bytes,
                       "p2p": role.observed.comm.get("pp", {}).get("pipeline", {}),
                       "flops_per_token": role.flops_per_token, "step": role.estimate.as_dict()}
                      for role in result.stage_roles]}


def write_json(result, cfg, path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(as_dict(result, cfg), indent=1) + "\n")


def _unit(result) -> tuple[str, int]:
    return ("GiB", GIB) if max(r.peak_bytes for r in result.roles) >= GIB else ("MiB", 1024 ** 2)


def _amount(nbytes: float, scale: int) -> str:
    return f"{nbytes / scale:8.3f}"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _time(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.3f} ms"


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _float8_note(cfg, profile) -> str:
    recipe = cfg.parallel.float8
    if recipe == "none":
        return ""
    return f"; the blocks' linears in float8 {recipe}, {float8_speedup(profile.name, recipe):.2f}x their bf16 speed"


def render(result, cfg) -> str:
    e = result.estimate
    profile = device_profile(cfg.dryrun)
    lines = [f"dry run: {cfg.model.name}/{cfg.model.flavor}, mesh {result.mesh}, {result.world_size} simulated "
             f"ranks, global batch {cfg.training.global_batch} x seq {cfg.training.seq_len}, "
             f"micro-batches {cfg.training.micro_batches}, AC {cfg.parallel.activation_checkpoint}, "
             f"reshard {cfg.parallel.reshard_after_forward} ({result.seconds:.1f} s)"]
    lines += [f"note: {note}" for note in result.notes]
    unit, scale = _unit(result)
    lines += ["", f"memory per rank, {unit} (simulated step; peak = tracked tensor memory)",
              f"  {'ranks':<16}{'params':>9}{'grads':>9}{'optim':>9}{'peak':>9}"]
    for role in result.roles:
        lines.append(f"  {_ranks(role.ranks):<16}{_amount(role.param_bytes, scale)} {_amount(role.grad_bytes, scale)} "
                     f"{_amount(role.optimizer_bytes, scale)} {_amount(role.peak_bytes, scale)}")
    parts = ", ".join(f"{name} {nbytes / scale:.3f}" for name, nbytes in result.observed.at_peak.items() if nbytes)
    lines.append(f"  at rank 0's peak: {parts}")
    lines += _stage_roles(result, cfg, scale, unit)
    kinds_seen = {kind for phases in result.observed.comm.values() for kinds in phases.values() for kind in kinds}
    columns = KINDS + tuple(kind for kind in EXTRA_KINDS if kind in kinds_seen)
    lines += ["", "communication per step on rank 0 (simulated; count x full buffer)",
              f"  {'dim':<12}{'phase':<11}" + "".join(f"{k:>22}" for k in columns)]
    for dim, phases in result.observed.comm.items():
        for phase, kinds in phases.items():
            if phase == "pipeline":  # point to point: in the stage table above
                continue
            cells = []
            for kind in columns:
                v = kinds.get(kind)
                cells.append(f"{v['count']} x {_size(v['bytes'] / v['count'])}" if v else "-")
            lines.append(f"  {dim:<12}{phase:<11}" + "".join(f"{c:>22}" for c in cells))
    lines += ["", f"step time (analytic, {profile.name}: {profile.peak_flops / 1e12:.0f} TFLOP/s at "
              f"{profile.compute_efficiency:.0%}, {profile.intra_node_bytes_s / 1e9:.0f} GB/s in a node, "
              f"{profile.inter_node_bytes_s / 1e9:.0f} GB/s between nodes of {profile.gpus_per_node}; "
              f"FSDP traffic overlaps compute; TP, CP, EP, the pipeline group's and the optimizer's does not"
              f"{_float8_note(cfg, profile)})",
              "  comm per dim: " + ", ".join(f"{d} {_time(s)}" for d, s in e.comm_s.items())]
    if result.stage_roles:
        lines.append(f"  compute {_time(e.compute_s)} + exposed comm {_time(e.exposed_comm_s)} + bubble "
                     f"{_time(e.bubble_s)} ({e.bubble_fraction:.1%} of compute) + exposed point to point "
                     f"{_time(e.exposed_p2p_s)} = step {_time(e.step_s)} (the slowest stage role's)")
    else:
        lines.append(f"  compute {_time(e.compute_s)} + exposed comm {_time(e.exposed_comm_s)} = step {_time(e.step_s)}")
    lines.append(f"  {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}")
    lines += render_goodput(failure_goodput(result, cfg), cfg.dryrun)
    return "\n".join(lines)


def _p2p(kinds: dict, kind: str) -> str:
    value = kinds.get(kind)
    return f"{value['count']} x {_size(value['bytes'] / value['count'])}" if value else "-"


def _stage_roles(result, cfg, scale: int, unit: str) -> list[str]:
    """Under pipeline parallel, one line per simulated stage role."""
    if not result.stage_roles:
        return []
    p, roles = cfg.parallel, result.stage_roles
    lines = ["", f"pipeline: {p.pp_schedule}, {p.pp_stages_per_rank} stage(s) per rank, "
                 f"{cfg.training.micro_batches} micro-batches; each distinct stage role simulated "
                 f"(peak with the micro-batches in flight, {unit})",
             f"  {'pp rank':<9}{'stages':<9}{'blocks':>7}{'peak':>10}{'sends':>20}{'receives':>20}{'step':>13}"]
    for role in roles:
        kinds = role.observed.comm.get("pp", {}).get("pipeline", {})
        lines.append(f"  {role.pp_rank:<9}{','.join(map(str, role.stages)):<9}{role.blocks:>7}"
                     f"{role.observed.peak_bytes / scale:>10.3f}{_p2p(kinds, 'send'):>20}{_p2p(kinds, 'recv'):>20}"
                     f"{_time(role.estimate.step_s):>13}")
    lines.append("  (a role's later pp ranks, listed with it in the memory table, hold the same state and no more "
                 "micro-batches in flight: its peak bounds theirs)")
    return lines


def render_outcome(outcome) -> str:
    """One searched layout, as it is simulated: the progress of --plan-for."""
    peak = f"peak {outcome.peak_bytes / GIB:6.1f} GiB"
    if outcome.error:
        return (f"  fail  {outcome.layout.command_line()}\n        {outcome.reason}: "
                f"{outcome.error.splitlines()[0]}")
    if outcome.estimate is None:
        return f"  {'drop' if outcome.simulated else 'skip'}  {outcome.layout.command_line()}\n        {outcome.reason}"
    e = outcome.estimate
    return (f"  fits  {outcome.layout.command_line()}\n        {peak}, step {_time(e.step_s)}, "
            f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}")


def render_plan(cfg, world: int, depth: int, outcomes, user_overrides=()) -> str:
    """The header of --plan-for (outcomes None), or its summary: the best layouts as commands."""
    from engine.dryrun.search import HEADROOM, pipeline_sizes, plan_has_stages
    dry = cfg.dryrun
    if outcomes is None:
        pipelines = ""
        if plan_has_stages(cfg) and max(pipeline_sizes(cfg)) > 1:
            pipelines = ("\nwith pp: each stage role combined from pipelines of fewer ranks over fewer "
                         "micro-batches (at 2 and 3 blocks per stage, extrapolated, where its stages hold more)")
        return (f"plan for {cfg.model.name}/{cfg.model.flavor} on {world} x {dry.device} "
                f"({dry.gpu_memory_gib:g} GiB each, {1 - HEADROOM:.0%} of it for tensors; {dry.gpus_per_node} per "
                f"node), global batch {cfg.training.global_batch} x seq {cfg.training.seq_len}\n"
                f"each layout: rank 0 simulated at two depths one block apart (with selective AC, "
                f"parallel.checkpoint_every blocks apart), extrapolated to "
                f"{depth}; step time analytic "
                f"(docs/planning.md){pipelines}")
    fits = [o for o in outcomes if o.estimate is not None]
    skipped = sum(not o.simulated for o in outcomes)
    failed = [o for o in outcomes if o.error]
    lines = ["", f"searched {len(outcomes)} layouts: {len(fits)} fit, "
                 f"{len(outcomes) - len(fits) - skipped - len(failed)} do not"
                 + (f", {skipped} left out as no faster than one that fits" if skipped else "")
                 + (f", {len(failed)} could not be simulated" if failed else "")]
    if failed:
        lines.append(f"{len(failed)} layout(s) raised an error when simulated (first: "
                     f"{failed[0].error.splitlines()[0]}), and a mesh whose layouts raised the same error twice "
                     f"was left there, so the ranking below may miss a faster layout. That is a bug, in the engine "
                     f"or in a model or plan of your own, not a layout that does not fit: for its traceback, rerun "
                     f"a \"fail\" line above alone with --dry-run --world {world}.")
    if not fits:
        lines.append("none fits: use more GPUs, a shorter training.seq_len or a smaller training.global_batch")
        return "\n".join(lines)
    base = " ".join(f"--set {o}" for o in user_overrides)
    lines.append(f"best {min(dry.top, len(fits))}, fastest first (predicted):")
    for place, outcome in enumerate(fits[:dry.top], 1):
        e = outcome.estimate
        lines += [f"{place}. {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}, step {_time(e.step_s)}, "
                  f"peak {outcome.peak_bytes / GIB:.1f} GiB",
                  f"   python launch/run.py {base + ' ' if base else ''}{outcome.layout.command_line()}"]
    return "\n".join(lines)


def write_plan_json(outcomes, cfg, world: int, path: str, complete: bool = True) -> None:
    """The search's layouts, best first; `complete` false while it runs (each layout is
    written as it is found, so an interrupted search keeps them). Written whole or not at
    all: a stop between two writes leaves the previous one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    layouts = [{"mesh": str(o.layout.spec), "overrides": o.layout.overrides(), "fits": o.estimate is not None,
                "peak_bytes": o.peak_bytes, "reason": o.reason, "simulated": o.simulated, "error": o.error,
                "step": o.estimate.as_dict() if o.estimate else None}
               for o in outcomes]
    written = target.with_name(target.name + ".partial")
    written.write_text(json.dumps({"version": VERSION, "model": f"{cfg.model.name}/{cfg.model.flavor}",
                                   "world_size": world, "complete": complete, "device": dict(vars(cfg.dryrun)),
                                   "layouts": layouts}, indent=1) + "\n")
    os.replace(written, target)
