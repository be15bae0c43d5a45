"""A sublayer's input freed from its forward to its backward, where only that sublayer
reads it and it is cheap to compute again (a norm's output, Plan.recomputed_outputs).

Under parallel.recompute_cheap each sublayer is a selective checkpoint, and a checkpoint
keeps its input for the recompute in backward; the input of attention and of the MLP is
their norm's output, one hidden state per block each. The norm registers its output with
how to compute it again (`recomputable`); the sublayer that reads it frees its storage
after its own forward and, in a hook on its output's gradient, which arrives before its
backward, computes it into the same storage (`free_until_backward`). Megatron frees its
recomputed norms' outputs the same way. Eager only (parallel/apply.py decides).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

# Outputs that the next sublayer alone reads -> how to compute each again.
_RECOMPUTABLE = WeakIdKeyDictionary()


def recomputable(output, again) -> None:
    """Register `output` (a tensor) to be freed by the sublayer that reads it; `again()`
    computes it anew."""
    if isinstance(output, torch.Tensor):
        _RECOMPUTABLE[output] = again


def _local(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return (tensor.storage_offset() == 0 and tensor.is_contiguous()
            and storage.nbytes() == tensor.numel() * tensor.element_size())


def free_until_backward(inputs, output) -> None:
    """Free each of `inputs` that was registered (`recomputable`) and owns its whole
    storage, and compute it again into that storage when `output`'s gradient arrives."""
    if not (isinstance(output, torch.Tensor) and output.requires_grad):
        return
    for value in inputs:
        again = _RECOMPUTABLE.pop(value, None) if isinstance(value, torch.Tensor) else None
        if again is None or not _owns_its_storage(local := _local(value)):
            continue
        storage = local.untyped_storage()
        pending = [local, storage, storage.nbytes(), again]
        storage.resize_(0)

        def restore(grad, pending=pending):
            # The hook outlives the backward (on the graph, which the loss keeps to the
            # step's end), so it lets go of what it restored.
            local, storage, size, again = pending
            pending.clear()
            storage.resize_(size)
            # Through .data: the checkpoint saved its input for backward and refuses one
            # whose version moved; these are the values it had.
            with torch.no_grad():
                local.data.copy_(_local(again()))

        output.register_hook(restore)
