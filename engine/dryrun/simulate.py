"""The dry run proper: the real mesh, model and plan for one rank of a fake N-rank world,
then one observed step under fake tensors (observe.py), then the step-time estimate.

What runs the engine's own code: the mesh, the plan (TP/SP, AC, FSDP with its reshard
setting, mixed precision, offload, prefetch), the optimizer and train_step, so state
bytes, collectives and tracked memory come from the code a real rank runs. What is
modelled instead: torch.compile (blocks run eagerly; collectives are the same, while
inductor's fusions would lower activation memory and time) and the step time
(estimate.py). The full step is simulated for rank 0; the other distinct roles (first
and last coordinates of dp and tp, which hold different shard sizes when a dimension
does not divide evenly) get their own parameters and optimizer state, and rank 0's
gradients, gathered parameters and activations, which depend only on padded shapes.

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
from engine.dryrun.estimate import StepEstimate, device_profile, estimate_step
from engine.dryrun.observe import Observation, create_optimizer_state, observe_step
from engine.dryrun.record import optimizer_bytes, param_bytes


@dataclass
class Role:
    ranks: list[int]  # the corner ranks that share this role
    param_bytes: int
    optimizer_bytes: int
    grad_bytes: int
    peak_bytes: int


@dataclass
class DryRunResult:
    world_size: int
    mesh: str
    observed: Observation  # rank 0
    roles: list[Role]
    estimate: StepEstimate
    flops_per_token: float
    seconds: float
    notes: list[str] = field(default_factory=list)


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
    that already: meshes of any shape can be built in one world (--plan-for does)."""
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) == (world_size, rank):
            return
        dist.destroy_process_group()
    torch_internals.start_fake_world(world_size, rank)


def _rank_model(cfg, spec, world_size: int, rank: int, n_layers: int = 0):
    """This rank's model after the plan, on meta, and its mesh (`n_layers` > 0: that depth)."""
    from models import build_on_meta
    from parallel.apply import apply_plan
    from parallel.mesh import build_mesh
    from parallel.plan import get_plan

    enter_fake_world(world_size, rank)
    dims = build_mesh(spec, "cpu")
    model = build_on_meta(cfg.model.name, cfg.model.flavor, n_layers)
    apply_plan(model, get_plan(cfg.parallel.plan), dims, cfg.parallel, cfg.prefetch)
    return model, dims


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


def observe_rank_zero(cfg, spec, world_size: int, n_layers: int = 0) -> Observation:
    """Rank 0's simulated step, at the model's depth or at `n_layers` blocks."""
    model, dims = _rank_model(cfg, spec, world_size, 0, n_layers)
    with torch_internals.fake_tensor_mode():
        model.to_empty(device="cpu")
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        return observe_step(model, cfg, dims, torch.device("cpu"), fake=True)


def simulate(cfg, spec, world_size: int, n_layers: int = 0) -> DryRunResult:
    """One step of `spec` on `world_size` ranks; `n_layers` > 0 builds that many blocks."""
    from engine.metrics.throughput import flops_per_token
    from engine.train import build_optimizer

    torch_internals.check_supported()
    started = time.perf_counter()
    cfg, notes = eager(cfg)
    profile = device_profile(cfg.dryrun)
    roles: dict[tuple[int, int], Role] = {}
    observed = None
    fake_mode = torch_internals.fake_tensor_mode()
    corners = corner_ranks(spec)
    for rank in corners:
        model, dims = _rank_model(cfg, spec, world_size, rank, n_layers)
        with fake_mode:
            model.to_empty(device="cpu")
            if hasattr(model, "tie_weights"):
                model.tie_weights()
            if observed is None:
                observed = observe_step(model, cfg, dims, torch.device("cpu"), fake=True)
                fpt = flops_per_token(model, cfg.training.seq_len)
                params, optim = observed.param_bytes, observed.optimizer_bytes
            else:
                optimizer, _ = build_optimizer(model, cfg.optim, cfg.training.steps)
                create_optimizer_state(model, optimizer)
                params, optim = param_bytes(model), optimizer_bytes(optimizer)
        key = (params, optim)
        if key in roles:
            roles[key].ranks.append(rank)
        else:
            extra = params + optim - observed.param_bytes - observed.optimizer_bytes
            roles[key] = Role([rank], params, optim, observed.grad_bytes, observed.peak_bytes + extra)
        if rank == 0 and shards_evenly(model):  # then every corner holds what rank 0 holds
            roles[key].ranks = corners
            break
    dist.destroy_process_group()
    estimate = estimate_step(observed.comm, fpt, cfg, spec, profile)
    return DryRunResult(world_size, str(spec), observed, list(roles.values()), estimate, fpt,
                        time.perf_counter() - started, notes)
