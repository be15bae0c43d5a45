"""Give a meta-device (and possibly sharded) model real storage and initial values.

A seed gives the same full weights on every layout, with no communication. Three
ways, in the order the model's members allow (docs/plans.md, "The model contract"):

- `init_distribution(fqn)`: each rank draws only the values of its own shard from
  streams fixed by the seed, the name and the position (models/initial_values.py),
  so its cost follows its shard;
- `init_value(fqn, shape, generator)`: the model draws one whole parameter on the
  CPU from a generator seeded by its name, and each rank keeps its slice;
- otherwise each module holding parameters runs its own `reset_parameters()` on a
  whole-size CPU stand-in, seeded by the module's path, and each rank keeps its slice.

The last two cost one whole-size draw per parameter per rank.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from models.initial_values import draw_block, matrix_shape, parameter_key


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


def held_along(param: torch.Tensor, dim: int) -> torch.Tensor:
    """The global indices along `dim` of this rank's elements, in local order: an index
    probe sharded like the parameter along `dim`, and so sliced by the same rules."""
    size = param.shape[dim]
    if not isinstance(param, DTensor):
        return torch.arange(size)
    probe = torch.arange(size).view([size if d == dim else 1 for d in range(param.ndim)])
    # By `.dim`, not is_shard(): FSDP's _StridedShard (dim 0 under tensor parallel) is a
    # Shard subclass on some torch versions and not on others (2.13: is_shard() is False).
    placements = [p if getattr(p, "dim", None) == dim else Replicate() for p in param.placements]
    local = distribute_tensor(probe, param.device_mesh, placements, src_data_rank=None).to_local()
    return local.flatten().cpu()


def _span(indices: torch.Tensor) -> tuple[int, int, bool]:
    """(first, past the last, whether the indices are exactly that range in order)."""
    low, high = int(indices.min()), int(indices.max()) + 1
    return low, high, indices.numel() == high - low and bool((indices.diff() == 1).all())


def _draw_my_part(param: torch.Tensor, distribution, key: int) -> None:
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    held = [held_along(param, dim) for dim in range(param.ndim)]
    rows = held[0] if held else torch.zeros(1, dtype=torch.long)
    cols = torch.zeros(1, dtype=torch.long)
    stride = matrix_shape(tuple(param.shape))[1]
    for dim in range(1, param.ndim):  # flatten dims 1.. in row-major order, as the local tensor is
        stride //= param.shape[dim]
        cols = (cols[:, None] + held[dim][None, :] * stride).flatten()
    (r0, r1, rows_in_order), (c0, c1, cols_in_order) = _span(rows), _span(cols)
    region = (tuple(param.shape), (r0, r1), (c0, c1))
    # In place through numpy where the shard is a plain CPU fp32 tensor; a tensor subclass
    # (torchao's weight for float8 all-gathers) takes the values through copy_.
    if rows_in_order and cols_in_order and local.device.type == "cpu" and local.dtype == torch.float32 \
            and local.is_contiguous() and type(local) is torch.Tensor:
        draw_block(distribution, key, *region, out=local.detach().view(r1 - r0, c1 - c0).numpy())  # in place
        return
    block = torch.from_numpy(draw_block(distribution, key, *region))
    if not rows_in_order:
        block = block.index_select(0, rows - r0)
    if not cols_in_order:
        block = block.index_select(1, cols - c0)
    local.copy_(block.view(local.shape))


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
def materialise(model: torch.nn.Module, device: torch.device | str, seed: int,
                parameter_device: torch.device | str | None = None) -> None:
    """`parameter_device` (default `device`) holds the parameters; buffers go to `device`.
    FSDP's CPU offload wants its sharded parameters on the CPU, while the buffers (RoPE
    tables, say) are read by the forward on the GPU."""
    model.to_empty(device=parameter_device or device)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != torch.device(device):
                module._buffers[name] = buffer.to(device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # moving plain tensors off meta replaces them, which unties them
    if callable(getattr(model, "init_distribution", None)):
        for fqn, param in model.named_parameters():
            _draw_my_part(param, model.init_distribution(fqn), parameter_key(seed, fqn))
    elif callable(getattr(model, "init_value", None)):
        for fqn, param in model.named_parameters():
            generator = torch.Generator().manual_seed(parameter_seed(seed, fqn))
            _keep_my_slice(param, model.init_value(fqn, tuple(param.shape), generator))
    else:
        _reset_each_module(model, seed)
    if callable(getattr(model, "reset_buffers", None)):
        model.reset_buffers()
