"""Give a meta-device (and possibly sharded) model real storage and initial values.

Every full initial value is drawn on the CPU from a generator seeded by the run
seed and a name, then this rank keeps only its own slice. So a seed gives the
same full weights on every layout, with no communication. A model's own
`init_value(fqn, shape, generator)` draws one parameter, seeded by its name;
without it, each module holding parameters runs its own `reset_parameters()`
on a CPU stand-in, seeded by the module's path (docs/plans.md, "The model
contract"). The cost is one full-size draw per parameter per rank.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def parameter_seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63)


def _keep_my_slice(param: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank slices its own part, nothing is sent.
        mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(mine.to_local())
    else:
        param.copy_(full)


def _cpu_stand_in(module: nn.Module) -> nn.Module:
    """A copy of `module` whose own parameters are full-size empty CPU tensors (its
    children are stand-ins too, in case reset_parameters reaches into them)."""
    # object.__new__ skips the class's own __new__: FSDP's re-runs __init__ without arguments.
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in._parameters = {name: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                            for name, p in module._parameters.items()}
    stand_in._buffers = dict(module._buffers)
    stand_in._modules = {name: None if child is None else _cpu_stand_in(child)
                         for name, child in module._modules.items()}
    return stand_in


def _reset_each_module(model: nn.Module, seed: int) -> None:
    done: set[int] = set()
    for path, module in model.named_modules():
        own = [(name, p) for name, p in module._parameters.items() if p is not None and id(p) not in done]
        if not own:
            continue
        stand_in = _cpu_stand_in(module)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(parameter_seed(seed, path))
            stand_in.reset_parameters()
        for name, param in own:
            _keep_my_slice(param, stand_in._parameters[name].detach())
            done.add(id(param))


@torch.no_grad()
def materialise(model: torch.nn.Module, device: torch.device | str, seed: int) -> None:
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # moving plain tensors off meta replaces them, which unties them
    if callable(getattr(model, "init_value", None)):
        for fqn, param in model.named_parameters():
            generator = torch.Generator().manual_seed(parameter_seed(seed, fqn))
            _keep_my_slice(param, model.init_value(fqn, tuple(param.shape), generator))
    else:
        _reset_each_module(model, seed)
    if callable(getattr(model, "reset_buffers", None)):
        model.reset_buffers()
