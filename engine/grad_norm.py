"""Gradient norm and clipping for parameters that live on different meshes.

torch's clip_grad_norm_ stacks every per-parameter norm into one tensor, which
fails as soon as two parameters sit on different meshes (TP without sequence
parallel leaves the norm weights on the data-parallel mesh only). Here the
norms are grouped by (mesh, placements); each group is reduced on its own mesh
and the group totals, now plain numbers equal on every rank, are combined.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _group_key(grad: torch.Tensor):
    if isinstance(grad, DTensor):
        return (grad.device_mesh, tuple(grad.placements))
    return None


def _reduce_over_shards(local: torch.Tensor, key, norm_type: float) -> torch.Tensor:
    """Combine per-rank partial results over the mesh dimensions that shard the group.
    Replicated dimensions already hold the whole value and are left alone."""
    if key is None:
        return local
    mesh, placements = key
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for dim, placement in enumerate(placements):
        # Not is_shard(): FSDP over TP uses _StridedShard, which does not count as a Shard.
        if not placement.is_replicate():
            dist.all_reduce(local, op=op, group=mesh.get_group(dim))
    return local


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients taken together, as if each were one full tensor."""
    groups: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(_group_key(param.grad), []).append(param.grad)
    inf = math.isinf(norm_type)
    total = torch.tensor(0.0)
    for key, grads in groups.items():  # insertion order: the same on every rank
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in local])
        # Partial results: the max for the inf-norm, else the sum of |g|^p.
        partial = norms.max() if inf else norms.pow(norm_type).sum()
        partial = _reduce_over_shards(partial, key, norm_type).cpu()
        total = torch.maximum(total, partial) if inf else total + partial
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so that their total norm is at most `max_norm`; returns the norm before."""
    parameters = list(parameters)
    total = grad_norm(parameters, norm_type)
    if max_norm > 0 and math.isfinite(total.item()):
        scale = min(1.0, max_norm / (total.item() + 1e-6))
        if scale < 1.0:
            for param in parameters:
                if param.grad is not None:
                    param.grad.mul_(scale)
    return total
