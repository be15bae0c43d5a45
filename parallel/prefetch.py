"""Explicit FSDP2 prefetch: which blocks' all-gathers a block issues ahead of its own compute.

FSDP2's implicit schedule issues a block's all-gather in that block's own pre-forward
and, in backward, prefetches one block back. A depth N > 0 replaces that: in forward,
the root and each block issue the all-gathers of the next N blocks; in backward, of
the N blocks before it. The backward list is the forward order reversed, which is the
order gradients are produced whatever recomputes in between: under activation
checkpointing FSDP2's pre-forward hook returns early during recomputation (the
pre-backward hook has already unsharded the block), so recomputation issues no
forward prefetch and cannot reorder this schedule.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from common.errors import UserError
from parallel.plan import Plan, expand, is_stage_part


def prefetch_order(model: nn.Module, plan: Plan) -> list[FSDPModule]:
    """The blocks in forward execution order: the plan's own order, else model order."""
    paths = list(plan.prefetch_order) if plan.prefetch_order is not None else expand(model, plan.blocks, plan.name)
    modules = dict(model.named_modules())
    if is_stage_part(model):  # a pipeline stage prefetches only the blocks it holds
        paths = [path for path in paths if path in modules]
    blocks = []
    for path in paths:
        block = modules.get(path)
        if not isinstance(block, FSDPModule) or block is model:
            raise UserError(f"plan {plan.name!r}: prefetch_order names {path!r}, which is not one of the "
                            f"plan's FSDP blocks ({plan.blocks!r}). List block paths in forward order.")
        blocks.append(block)
    return blocks


def apply_prefetch(model: FSDPModule, blocks: list[FSDPModule], forward: int, backward: int) -> None:
    """Set explicit prefetch lists; a depth of 0 keeps FSDP2's implicit behaviour."""
    if forward > 0:
        order = [model, *blocks]
        for i, module in enumerate(order[:-1]):
            module.set_modules_to_forward_prefetch(order[i + 1:i + 1 + forward])
    if backward > 0:
        order = [model, *reversed(blocks)]
        for i, module in enumerate(order[:-1]):
            module.set_modules_to_backward_prefetch(order[i + 1:i + 1 + backward])


def unshard_ahead(orders: list[tuple[FSDPModule, list[FSDPModule]]], count: int) -> None:
    """Start the all-gathers of each root and its first `count` blocks without waiting, so
    they overlap with whatever runs before the forward (moving the batch to the device).
    Each module's pre-forward waits for its own handle. `orders` holds (root, blocks in
    forward order): one pair, or one per pipeline stage this rank holds."""
    for model, blocks in orders:
        for module in [model, *blocks[:count]]:
            module.unshard(async_op=True)
