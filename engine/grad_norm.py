"""Gradient norm and clipping for parameters that live on different meshes.

torch's clip_grad_norm_ stacks every per-parameter norm into one tensor, which
fails as soon as two parameters sit on different meshes (TP without sequence
parallel leaves the norm weights on the data-parallel mesh only). Here each rank
takes the norm of its local shards, and the partial results are reduced over the
process groups of the mesh dimensions that split them. Partials that need the same
groups are combined first, so each distinct set of groups costs one all-reduce per
group however many layouts share it; the totals, equal on every rank, are combined.
Under pipeline parallel each rank holds only its stages' parameters, so the total is
then reduced over the pipeline group as well, with each shared parameter (a tied
embedding copied onto two stages) counted once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _splitting_groups(grad: torch.Tensor) -> tuple:
    """The process groups over which this gradient's shards must be combined, and the device
    type their collectives take (a CUDA mesh's, also for shards offloaded to the CPU).
    Replicated dimensions already hold the whole value and are left out."""
    if not isinstance(grad, DTensor):
        return ()
    # Not is_shard(): FSDP over TP uses _StridedShard, which does not count as a Shard.
    groups = tuple(grad.device_mesh.get_group(dim)
                   for dim, placement in enumerate(grad.placements) if not placement.is_replicate())
    return (grad.device_mesh.device_type, *groups) if groups else ()


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0, stages=None) -> torch.Tensor:
    """The norm of all gradients taken together, as if each were one full tensor; `stages`,
    the pipeline group, adds the other stages' gradients."""
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_groups.setdefault(_splitting_groups(param.grad), []).append(_local(param.grad))
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.tensor(0.0)
    for key, grads in by_groups.items():  # insertion order: the same on every rank
        norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
        # Partial results: the max for the inf-norm, else the sum of |g|^p.
        partial = norms.max() if inf else norms.pow(norm_type).sum()
        if key:
            device_type, *groups = key
            partial = partial.to(device_type)
            for group in groups:
                dist.all_reduce(partial, op=op, group=group)
        partial = partial.cpu()
        total = torch.maximum(total, partial) if inf else total + partial
    if stages is not None:
        total = total.to("cuda" if dist.get_backend(stages) == "nccl" else "cpu")  # NCCL takes no CPU tensors
        dist.all_reduce(total, op=op, group=stages)
        total = total.cpu()
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0,
                   stages=None, counted: list | None = None) -> torch.Tensor:
    """Scale gradients so that their total norm is at most `max_norm`; returns the norm before.
    `counted` (default: all of `parameters`) are those the norm counts; `stages` as in grad_norm."""
    parameters = list(parameters)
    total = grad_norm(parameters if counted is None else counted, norm_type, stages)
    if max_norm > 0 and math.isfinite(total.item()):
        scale = min(1.0, max_norm / (total.item() + 1e-6))
        if scale < 1.0:
            # On the local shards in one call: a DTensor op per gradient costs a dispatch each.
            torch._foreach_mul_([_local(p.grad) for p in parameters if p.grad is not None], scale)
    return total
