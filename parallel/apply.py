"""Applies a plan to a meta-device model. The order lives here and only here:

1. tensor parallel on the TP sub-mesh (then shared weights are tied again),
2. fully_shard on every block,
3. fully_shard on the root, which takes the remaining parameters,
4. explicit prefetch lists, when the config asks for them (parallel/prefetch.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from parallel.mesh import ParallelDims
from parallel.plan import Plan, expand
from parallel.prefetch import apply_prefetch, prefetch_order


def apply_tensor_parallel(model: nn.Module, plan: Plan, dims: ParallelDims) -> None:
    styles = {path: style
              for pattern, style in plan.tensor_parallel.items()
              for path in expand(model, pattern, plan.name)}
    parallelize_module(model, dims.tp, styles)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # TP replaced the parameters, which breaks any sharing


def apply_fsdp(model: nn.Module, plan: Plan, dims: ParallelDims) -> None:
    for path in expand(model, plan.blocks, plan.name):
        fully_shard(model.get_submodule(path), mesh=dims.fsdp, reshard_after_forward=True)
    fully_shard(model, mesh=dims.fsdp)


def apply_plan(model: nn.Module, plan: Plan, dims: ParallelDims, prefetch=None) -> nn.Module:
    """`prefetch` is the config's PrefetchConfig; None keeps FSDP2's implicit prefetch."""
    if dims.tp_enabled:
        apply_tensor_parallel(model, plan, dims)
    apply_fsdp(model, plan, dims)
    if prefetch is not None:
        apply_prefetch(model, prefetch_order(model, plan), prefetch.forward, prefetch.backward)
    return model
