"""Give a meta-device (and possibly sharded) model real storage and initial values.

Each parameter's full value is drawn on the CPU from a generator seeded by the
run seed and the parameter's name, then this rank keeps only its own slice. So
a seed gives the same full weights on every layout, with no communication. The
cost is one full-size draw per parameter per rank, which is fine up to the
largest single tensor (about 4 GB for a 128k x 8192 embedding).
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def parameter_seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63)


@torch.no_grad()
def materialise(model: torch.nn.Module, device: torch.device | str, seed: int) -> None:
    """`model` must provide `init_value(fqn, shape, generator)` and `reset_buffers()`,
    and `tie_weights()` if it shares parameters between modules."""
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # moving plain tensors off meta replaces them, which unties them
    for fqn, param in model.named_parameters():
        generator = torch.Generator().manual_seed(parameter_seed(seed, fqn))
        full = model.init_value(fqn, tuple(param.shape), generator).to(param.dtype)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank slices its own part, nothing is sent.
            mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(mine.to_local())
        else:
            param.copy_(full)
    model.reset_buffers()
