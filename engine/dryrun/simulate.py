"""The dry run proper: the real mesh, model and plan for one rank of a fake N-rank world,
then one observed step under fake tensors (observe.py), then the step-time estimate.

What runs the engine's own code: the mesh, the plan (TP/SP, AC, FSDP with its reshard
setting, mixed precision, offload, prefetch, ep), the optimizer and train_step, so state
bytes, collectives and tracked memory come from the code a real rank runs. What is
modelled instead: torch.compile (blocks run eagerly; collectives are the same, while
inductor's fusions would lower activation memory and time), a mixture of experts'
routing (the rows per expert at dryrun.expert_load: prepare_experts) and the step time
(estimate.py). The full step is simulated for rank 0; the other distinct roles (first
and last coordinates of dp and tp, which hold different shard sizes when a dimension
does not divide evenly) get their own parameters and optimizer state, and rank 0's
gradients, gathered parameters and activations, which depend only on padded shapes.
Under pipeline parallel the stages differ in what they hold and in the micro-batches
in flight, so the full step is simulated for the first rank of each distinct stage role
(the first stage, the last, and each middle one with another number of blocks).

One process simulates one layout: torch caches DTensor sharding decisions by mesh,
and a second fake world in the same process reuses the first one's process-group
names, so a different mesh simulated afterwards can run collectives on stale groups.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.dryrun import torch_internals
from common.errors import UserError
from engine.dryrun.estimate import StepEstimate, device_profile, estimate_step, float8_speedup
from engine.dryrun.observe import Observation, create_optimizer_state, observe_step
from engine.dryrun.record import groups_named_in_this_world, optimizer_bytes, param_bytes
from engine.train import build_optimizer


@dataclass
class Role:
    ranks: list[int]  # the corner ranks that share this role (the first was simulated; see pipeline_ranks)
    param_bytes: int
    optimizer_bytes: int
    grad_bytes: int
    peak_bytes: int


@dataclass
class StageRole:
    """One pipeline rank's simulated step, for each distinct role (pipeline_ranks)."""
    pp_rank: int
    stages: list[int]
    blocks: int
    observed: Observation
    flops_per_token: float  # of the stages this rank holds
    estimate: StepEstimate


@dataclass
class DryRunResult:
    world_size: int
    mesh: str
    observed: Observation  # rank 0
    roles: list[Role]
    estimate: StepEstimate  # with pp: the slowest stage role's, which paces the pipeline
    flops_per_token: float
    seconds: float
    notes: list[str] = field(default_factory=list)
    stage_roles: list[StageRole] = field(default_factory=list)  # with pp > 1


def corner_ranks(spec) -> list[int]:
    """Rank 0 first, then the ranks at the first and last coordinates of FSDP's shard group
    (dp, or dp x cp) and of tp."""
    ranks = []
    for shard in sorted({0, spec.shard_size - 1}):
        for tp in sorted({0, spec.tp - 1}):
            rank = shard * spec.tp + tp
            if rank not in ranks:
                ranks.append(rank)
    return ranks


def shards_evenly(model) -> bool:
    """Whether every rank holds the same shard shapes: each sharded dimension of each
    parameter divides by the product of the mesh sizes that shard it."""
    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        ways = {}
        for size, placement in zip(param.device_mesh.shape, param.placements):
            if placement.is_shard():
                ways[placement.dim] = ways.get(placement.dim, 1) * size
        if any(param.shape[dim] % n for dim, n in ways.items()):
            return False
    return True


def enter_fake_world(world_size: int, rank: int) -> None:
    """Be `rank` of a fake world of `world_size` ranks, keeping the current one if it is
    that already: meshes of any shape can be built in one world (--plan-for does). A world
    kept keeps DTensor's cached sharding decisions too, which spares each simulation after
    the first most of its sharding propagation (docs/planning.md's 8B --plan-for with
    dryrun.search_workers=1, 2026-12-06: 45.4 s wall with the cache dropped between
    layouts, 38.6 s kept). Those decisions hold the meshes made before, which compare equal to a
    new layout's and name their own groups, still alive in this world; the recorder knows
    every group of the world by its dimension (record.groups_named_in_this_world), so a
    collective on one is named as on the new layout's."""
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) == (world_size, rank):
            return
        dist.destroy_process_group()
    torch_internals.start_fake_world(world_size, rank)


def pipeline_ranks(cfg, spec, n_layers: int = 0) -> dict[int, list[int]]:
    """The pp ranks to simulate -> the pp ranks each stands for: the first of each distinct
    role, a role being the block counts of the stages a rank holds (and how many of them
    are leading blocks, models.leading_blocks) and whether they include the first or the
    last. The ranks after it in a role hold the same state and no more micro-batches in
    flight (fewer, under 1F1B), so its peak bounds theirs."""
    from models import build_on_meta, leading_blocks
    from parallel.pipeline import blocks_per_stage, empty_ends, stages_of_rank
    from parallel.plan import expand, plan_of

    if spec.pp == 1:
        return {0: [0]}
    plan, options = plan_of(cfg), cfg.parallel
    model = build_on_meta(cfg.model.name, cfg.model.flavor, n_layers)
    blocks = len(expand(model, plan.blocks, plan.name))
    counts = blocks_per_stage(blocks, spec.pp, options.pp_stages_per_rank, options.pp_split, empty_ends(plan.stages))
    leading = leading_per_stage(counts, leading_blocks(model.args))
    roles: dict[tuple, list[int]] = {}
    for rank in range(spec.pp):
        stages = stages_of_rank(rank, spec.pp, options.pp_stages_per_rank, options.pp_schedule)
        key = tuple((counts[s], leading[s], s == 0, s == len(counts) - 1) for s in stages)
        roles.setdefault(key, []).append(rank)
    return {ranks[0]: ranks for ranks in roles.values()}


def leading_per_stage(counts: list[int], leading: int) -> list[int]:
    """How many of each stage's blocks (`counts`, in stage order) are among the model's
    first `leading` blocks."""
    starts = [sum(counts[:stage]) for stage in range(len(counts))]
    return [min(max(leading - start, 0), count) for start, count in zip(starts, counts)]


def _rank_model(cfg, spec, world_size: int, rank: int, n_layers: int = 0, dense_layers: int | None = None):
    """This rank's model after the plan, on meta, and its mesh (`n_layers` > 0: that depth,
    `dense_layers`: that many leading blocks, models.build_on_meta)."""
    from engine import routing
    from models import build_on_meta
    from parallel.apply import apply_plan
    from parallel.mesh import build_mesh
    from parallel.plan import plan_of

    enter_fake_world(world_size, rank)
    dims = build_mesh(spec, "cpu")
    groups_named_in_this_world(dims)  # for the later layouts whose cached sharding decisions name them
    model = build_on_meta(cfg.model.name, cfg.model.flavor, n_layers, dense_layers)
    prepare_experts(model, cfg.dryrun.expert_load, spec.ep)
    # A GPU job: float8 linears take the GPU's path (torch._scaled_mm, which fake tensors
    # run anywhere), not the CPU's emulation, whose dequantised copies a GPU never makes.
    model = apply_plan(model, plan_of(cfg), dims, cfg.parallel, cfg.prefetch, emulate_float8=False).model
    routing.configure(model, cfg.moe, (dims.cp.get_group(), spec.cp) if spec.cp > 1 else None)
    return model, dims


def prepare_experts(model, load: float, ep: int) -> None:
    """What a mixture of experts learns when it is materialised and when it routes, which a
    model of fake tensors does neither of: each MoE gets the rows per expert to simulate
    (models/moe.py: assumed_sizes), and each experts module the dtypes its grouped GEMM
    takes where the kernel runs (its meta kernel's: a GPU job's, and the CPU's where a
    real run on this torch takes it too; on torch 2.15 a CPU run's fp32 experts took it
    and their step's peak was 10% under the loop's)."""
    from models.moe import Experts, MoE, grouped_gemm_works
    mixtures = [module for module in model.modules() if isinstance(module, MoE)]
    if not mixtures:
        return
    check_expert_load(load, ep)
    grouped = frozenset(dtype for dtype in (torch.float32, torch.bfloat16)
                        if grouped_gemm_works(torch.device("meta"), dtype))
    for module in model.modules():
        if isinstance(module, MoE):
            module.assumed_load = (load, ep)
        if isinstance(module, Experts):
            module.grouped_dtypes = grouped


def check_expert_load(load: float, ep: int) -> None:
    if not 1 <= load <= ep:
        raise UserError(f"dryrun.expert_load={load} must be between 1 (every ep rank gets as many routed rows) "
                        f"and ep={ep} (one rank gets them all): it is the busiest ep rank's rows over the mean.")


def to_fake(model) -> None:
    """Fake storage for the meta parameters (in the fake tensor mode), each stage's part apart."""
    from parallel.pipeline import parts_of
    for part in parts_of(model):
        part.to_empty(device="cpu")
        if hasattr(part, "tie_weights"):
            part.tie_weights()


def refuse_split_backward(cfg, spec) -> None:
    """A zero-bubble schedule computes input gradients with autograd.grad, which the memory
    tracker's hooks on a stage's inputs do not support ("A leaf node was passed to
    _will_engine_execute_node but we are currently running autograd.grad()")."""
    from parallel.pipeline import ZERO_BUBBLE
    schedule = cfg.parallel.pp_schedule
    if spec.pp > 1 and schedule in ZERO_BUBBLE:
        raise UserError(f"--dry-run cannot simulate parallel.pp_schedule={schedule}: it splits each backward into "
                        f"input and weight passes, and torch's memory tracker fails inside the first (autograd.grad "
                        f"over a stage's received input). Simulate Interleaved1F1B with the same stages for its "
                        f"memory and messages (a zero-bubble schedule holds more while weight passes wait), or "
                        f"train it and read the memory in metrics.jsonl.")


def eager(cfg):
    """The config the step is simulated with, and the notes on what that changes."""
    notes = []
    if cfg.parallel.compile:
        notes.append("parallel.compile: blocks are simulated eagerly; collectives are the same, "
                     "activation memory is eager's (an upper bound)")
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, compile=False))
    if cfg.parallel.offload:
        notes.append("parallel.offload: sharded state is counted as if on the GPU (an upper bound)")
    return cfg, notes


def observe_rank_zero(cfg, spec, world_size: int, n_layers: int = 0, rank: int = 0,
                      dense_layers: int | None = None) -> Observation:
    """Rank 0's (or `rank`'s) simulated step, at the model's depth or at `n_layers` blocks
    (`dense_layers` of them leading, models.build_on_meta)."""
    model, dims = _rank_model(cfg, spec, world_size, rank, n_layers, dense_layers)
    with torch_internals.fake_tensor_mode():
        to_fake(model)
        return observe_step(model, cfg, dims, torch.device("cpu"), fake=True)


def rank_zero_state_bytes(cfg, spec, world_size: int, n_layers: int = 0) -> int:
    """Rank 0's parameters and optimizer state, without a step: what it holds throughout
    any step, whatever its AC mode, micro-batches or reshard setting (--plan-for's bound)."""
    model, _ = _rank_model(cfg, spec, world_size, 0, n_layers)
    with torch_internals.fake_tensor_mode():
        to_fake(model)
        return sum(held_state(model, cfg))


def held_state(model, cfg) -> tuple[int, int]:
    """A fake model's parameter bytes and optimizer-state bytes, in the steady state."""
    optimizer, _ = build_optimizer(model, cfg.optim, cfg.training.steps)
    create_optimizer_state(model, optimizer)
    return param_bytes(model), optimizer_bytes(optimizer)


def simulate(cfg, spec, world_size: int, n_layers: int = 0, trace: bool = False) -> DryRunResult:
    """One step of `spec` on `world_size` ranks; `n_layers` > 0 builds that many blocks;
    `trace`: each simulated step keeps its order (Observation.step_log)."""
    from engine.metrics.throughput import flops_per_token
    from models import build_on_meta

    torch_internals.check_supported()
    refuse_split_backward(cfg, spec)
    started = time.perf_counter()
    cfg, notes = eager(cfg)
    profile = device_profile(cfg.dryrun)
    float8_speedup(profile.name, cfg.parallel.float8)  # a device without float8 stops here
    fpt = flops_per_token(build_on_meta(cfg.model.name, cfg.model.flavor, n_layers), cfg.training.seq_len)
    roles: dict[tuple[int, int, int], Role] = {}
    stage_roles = []
    fake_mode = torch_internals.fake_tensor_mode()
    per_stage = world_size // spec.pp
    for pp_rank, alike in pipeline_ranks(cfg, spec, n_layers).items():
        corners = [pp_rank * per_stage + rank for rank in corner_ranks(spec)]
        observed = None
        for rank in corners:
            model, dims = _rank_model(cfg, spec, world_size, rank, n_layers)
            with fake_mode:
                to_fake(model)
                if observed is None:
                    observed = observe_step(model, cfg, dims, torch.device("cpu"), fake=True, trace=trace)
                    params, optim = observed.param_bytes, observed.optimizer_bytes
                    stage_roles.append(stage_role(model, pp_rank, observed, fpt, cfg, spec, profile))
                else:
                    params, optim = held_state(model, cfg)
            key = (pp_rank, params, optim)
            same = [other * per_stage + rank - pp_rank * per_stage for other in alike]  # in the alike pp ranks
            if key in roles:
                roles[key].ranks += same
            else:
                extra = params + optim - observed.param_bytes - observed.optimizer_bytes
                roles[key] = Role(same, params, optim, observed.grad_bytes, observed.peak_bytes + extra)
            if rank == corners[0] and shards_evenly(model):  # then every corner holds what this rank holds
                roles[key].ranks = sorted(other * per_stage + corner - pp_rank * per_stage
                                          for other in alike for corner in corners)
                break
    dist.destroy_process_group()
    slowest = max(stage_roles, key=lambda role: role.estimate.step_s)
    return DryRunResult(world_size, str(spec), stage_roles[0].observed, list(roles.values()), slowest.estimate, fpt,
                        time.perf_counter() - started, notes, stage_roles if spec.pp > 1 else [])


def stage_role(model, pp_rank: int, observed: Observation, whole_fpt: float, cfg, spec, profile) -> StageRole:
    """A simulated rank's step time: without pp the whole model's FLOPs; with pp those of
    the stages the rank holds, plus the schedule's bubble and its point-to-point traffic."""
    from engine.dryrun.estimate import (expert_flops_per_token, float8_flops_per_token, recomputed_flops_per_token,
                                        stage_flops_per_token)
    from parallel.pipeline import whole_model
    from parallel.plan import expand, plan_of

    pipeline = getattr(model, "pipeline", None)
    seq_len = cfg.training.seq_len
    if pipeline is None:
        plan = plan_of(cfg)
        blocks = expand(model, plan.blocks, plan.name)
        return StageRole(0, [0], 0, observed, whole_fpt,
                         estimate_step(observed.comm, whole_fpt, cfg, spec, profile,
                                       float8_flops=float8_flops_per_token(model, blocks, cfg.parallel.float8),
                                       expert_flops=expert_flops_per_token(model, blocks),
                                       recomputed_flops=recomputed_flops_per_token(model, [blocks], len(blocks),
                                                                                   cfg.parallel, seq_len)))
    whole = whole_model(model)
    fpt = stage_flops_per_token(whole, pipeline.stages, pipeline.stage_blocks, pipeline.stage_indices, seq_len)
    parts = [pipeline.stage_blocks[stage] for stage in pipeline.stage_indices]
    held = [path for part in parts for path in part]
    recomputed = recomputed_flops_per_token(whole, parts, sum(map(len, pipeline.stage_blocks)), cfg.parallel, seq_len)
    return StageRole(pp_rank, list(pipeline.stage_indices), len(held), observed, fpt,
                     estimate_step(observed.comm, whole_fpt, cfg, spec, profile, stage_flops=fpt,
                                   float8_flops=float8_flops_per_token(whole, held, cfg.parallel.float8),
                                   expert_flops=expert_flops_per_token(whole, held), recomputed_flops=recomputed))
