"""Integer `reshard_after_forward`: after forward, keep each parameter sharded over a
group of k ranks (the intra-node group) instead of the whole shard group, so the
backward all-gather stays on the fast links.

When the FSDP mesh is the whole world (no tp, no pp), fully_shard does this by itself
and the engine passes k on. Otherwise it cannot: fully_shard builds the post-forward
DeviceMesh from the calling rank's own dp row, so ranks with different tp (or pp)
coordinates issue different `new_group` calls and hang, and FSDP refuses to reshard
TP (DTensor) parameters onto a smaller mesh. So there the engine builds the
post-forward mesh once, the same way on every rank, as (pp, groups, k, tp) over the
whole world, and installs this rank's (groups, k, tp) slice on each FSDP parameter
group; TP parameters get a post-forward DTensor on that 3-D mesh with placements
(Replicate, <FSDP's shard placement>, <TP placement>). That part touches FSDP2
internals and lives in parallel/fsdp_internals.py.
"""

from __future__ import annotations

import os

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from common.errors import UserError
from parallel.fsdp_internals import check_supported
from parallel.mesh import MeshSpec, ParallelDims

POST_FORWARD_DIMS = ("post_replicate", "post_shard", "tp")


def ranks_per_node(spec: MeshSpec) -> int:
    """torchrun's LOCAL_WORLD_SIZE; the whole mesh when not under torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", spec.world_size))


def describe_auto(spec: MeshSpec) -> str:
    """What `auto` chose here and from what, for the run's header."""
    per_node = ranks_per_node(spec)
    return (f"reshard_after_forward=auto: {per_node} ranks per node (LOCAL_WORLD_SIZE), tp={spec.tp}, "
            f"dp={spec.dp} -> {resolve_reshard('auto', spec)}")


def resolve_reshard(setting, spec: MeshSpec, local_world_size: int | None = None) -> bool | int:
    """Turn the config value (true, false, an integer or "auto") into what FSDP takes.

    An integer k must divide the FSDP shard size (dp, times cp when there is one). k equal
    to it is plain True, and k == 1 keeps the whole parameter, which is False. "auto" picks
    the ranks of the shard group that share a node: LOCAL_WORLD_SIZE / tp, since tp is
    innermost.
    """
    if isinstance(setting, bool):
        return setting
    shard = spec.shard_size
    if setting == "auto":
        setting = max(1, (local_world_size or ranks_per_node(spec)) // spec.tp)
        while shard % setting:
            setting -= 1
        if setting == 1 and shard > 1:
            return True  # no two shard ranks share a node: reshard fully
    if not isinstance(setting, int) or isinstance(setting, bool):
        raise UserError(f"parallel.reshard_after_forward is {setting!r}; use true, false, auto or an integer.")
    if setting < 1 or shard % setting:
        divisors = [d for d in range(1, shard + 1) if shard % d == 0]
        what = f"dp={spec.dp}" if spec.cp == 1 else f"dp x cp = {shard}"
        raise UserError(
            f"parallel.reshard_after_forward={setting} must divide the FSDP shard size {what} "
            f"of --mesh {spec}: the parameters are resharded onto groups of that many ranks after "
            f"forward. Use one of {divisors}, true, false or auto.")
    if setting == shard:
        return True
    if setting == 1:
        return False
    return setting


def needs_own_post_forward_mesh(reshard: bool | int, spec: MeshSpec) -> bool:
    """An integer that fully_shard cannot apply by itself: one whose FSDP mesh is not the
    whole world (tensor or pipeline parallel)."""
    return not isinstance(reshard, bool) and (spec.tp > 1 or spec.pp > 1)


def build_post_forward_mesh(dims: ParallelDims, k: int) -> DeviceMesh:
    """(pp, hsdp*dp*cp/k, k, tp) over the whole world, built identically on every rank, and
    this rank's (hsdp*dp*cp/k, k, tp) slice of it. Rank order matches (pp, hsdp, dp, cp,
    tp), so each post_shard row is k consecutive members of one FSDP shard group (dp x cp)."""
    check_supported()
    spec = dims.spec
    world = init_device_mesh(dims.device_type, (spec.pp, spec.hsdp * spec.shard_size // k, k, spec.tp),
                             mesh_dim_names=("pp", *POST_FORWARD_DIMS))
    return world[POST_FORWARD_DIMS]
