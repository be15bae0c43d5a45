"""The one place the engine reaches into FSDP2's private internals, for two things:

1. installing its own post-forward mesh for integer `reshard_after_forward` with tensor
   or pipeline parallel (parallel/reshard.py says why fully_shard cannot do that by itself);
2. gradients reduced in place where FSDP shards over one rank (`reduce_in_place`).

What 1 touches, the same on torch 2.11 to 2.15 except where noted:

- FSDPState's parameter groups: `_fsdp_param_groups` (a list; 2.13 and later) or
  `_fsdp_param_group` (one group; 2.11 and 2.12);
- FSDPParamGroup.post_forward_mesh_info and .fsdp_params;
- FSDPParam.post_forward_mesh_info, ._orig_size, .is_dtensor, ._sharding_spec,
  ._init_sharded_post_forward_param_metadata(), .to_sharded_post_forward() and
  .to_sharded_post_forward_dtensor();
- _fsdp_common.HSDPMeshInfo and _from_local_no_grad, and DTensorSpec.

`check_supported` looks for all of it before any process group starts, so a torch
without it is refused with a message instead of failing mid-step;
tests/test_fsdp_internals.py runs it on every torch the compat run covers.

What 2 relies on: the public `FSDPModule.set_custom_reduce_scatter`, the private
`ReduceScatter` it takes, and the way `foreach_reduce` uses it (one buffer allocated for
the reduce-scatter's input, then one for its output; over one rank no collective, only
`reduce_output.copy_(reduce_scatter_input)`). `reduces_in_place` reads that from
foreach_reduce's source; where it does not find it, FSDP keeps its own copy.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from common.errors import UserError

_FSDP = "torch.distributed.fsdp._fully_shard"
NEEDED = {
    f"{_FSDP}._fsdp_param.FSDPParam": ("_init_sharded_post_forward_param_metadata",
                                       "to_sharded_post_forward", "to_sharded_post_forward_dtensor"),
    f"{_FSDP}._fsdp_param_group.FSDPParamGroup": ("_use_post_forward_mesh",),
    f"{_FSDP}._fsdp_common.HSDPMeshInfo": (),
    f"{_FSDP}._fsdp_common._from_local_no_grad": (),
    f"{_FSDP}._fsdp_state.FSDPState": (),
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": (),
}


def _find(dotted: str):
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def missing_internals() -> list[str]:
    missing = []
    for dotted, members in NEEDED.items():
        found = _find(dotted)
        if found is None:
            missing.append(dotted)
            continue
        missing += [f"{dotted}.{m}" for m in members if not hasattr(found, m)]
    state = _find(f"{_FSDP}._fsdp_state.FSDPState")
    if state is not None:
        fresh = state()
        if not (hasattr(fresh, "_fsdp_param_groups") or hasattr(fresh, "_fsdp_param_group")):
            missing.append("FSDPState._fsdp_param_groups (or _fsdp_param_group)")
    return missing


def check_supported() -> None:
    missing = missing_internals()
    if missing:
        raise UserError(
            f"an integer parallel.reshard_after_forward with tensor or pipeline parallel needs FSDP2 "
            f"internals that torch {torch.__version__} does not have ({', '.join(missing)}). Use "
            f"parallel.reshard_after_forward=true or false with tp > 1 or pp > 1 on this torch, or an "
            f"integer on a mesh without tp and pp, where fully_shard supports it by itself.")


def param_groups(module: nn.Module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def _post_forward_dtensor(fsdp_param, local: torch.Tensor, post_mesh: DeviceMesh) -> DTensor:
    """The post-forward parameter of a TP parameter: FSDP's shard placement now spans k
    ranks, the TP placement is unchanged."""
    spec_class = _find("torch.distributed.tensor._dtensor_spec.DTensorSpec")
    from_local_no_grad = _find(f"{_FSDP}._fsdp_common._from_local_no_grad")
    sharded = fsdp_param._sharding_spec
    placements = (Replicate(), sharded.placements[-2], sharded.placements[-1])
    return from_local_no_grad(local, spec_class(post_mesh, placements, tensor_meta=sharded.tensor_meta))


def _tp_aware_param_class(base):
    """FSDPParam whose post-forward reshard also accepts TP (DTensor) parameters."""

    class TPAwarePostForwardParam(base):
        """Installed on TP parameters only."""

        def to_sharded_post_forward(self) -> None:
            # FSDP's own steps apply unchanged; it refuses DTensors only for want of the
            # post-forward spec, which to_sharded_post_forward_dtensor below supplies.
            self.is_dtensor = False
            try:
                super().to_sharded_post_forward()
            finally:
                self.is_dtensor = True

        def to_sharded_post_forward_dtensor(self, tensor: torch.Tensor) -> DTensor:
            return _post_forward_dtensor(self, tensor, self._post_forward_world_mesh)

    return TPAwarePostForwardParam


_CLASSES: dict[type, type] = {}


def install_post_forward_mesh(module: nn.Module, post_mesh: DeviceMesh) -> None:
    """Make the FSDP unit `module` (already fully_shard-ed with reshard_after_forward=True)
    reshard after forward onto the groups along dimension 1 of the 3-D `post_mesh`
    (replicas, shard group, tp), built by parallel/reshard.py."""
    mesh_info_class = _find(f"{_FSDP}._fsdp_common.HSDPMeshInfo")
    replicas, shards, _ = post_mesh.mesh_dim_names
    info = mesh_info_class(post_mesh[replicas, shards], shard_mesh_dim=1, replicate_mesh_dim=0)
    for group in param_groups(module):
        group.post_forward_mesh_info = info
        for fsdp_param in group.fsdp_params:
            fsdp_param.post_forward_mesh_info = info
            fsdp_param._init_sharded_post_forward_param_metadata(
                torch.empty(fsdp_param._orig_size, device="meta"))
            if fsdp_param.is_dtensor:
                base = type(fsdp_param)
                fsdp_param.__class__ = _CLASSES.setdefault(base, _tp_aware_param_class(base))
                fsdp_param._post_forward_world_mesh = post_mesh


@functools.cache
def reduces_in_place() -> bool:
    """Whether this torch's foreach_reduce works as OneRankReduceInPlace expects (above)."""
    collectives = _find(f"{_FSDP}._fsdp_collectives")
    if _find(f"{_FSDP}._fsdp_api.ReduceScatter") is None or collectives is None:
        return False
    try:
        source = inspect.getsource(collectives.foreach_reduce)
    except (AttributeError, OSError, TypeError):
        return False
    allocations = re.findall(r"(\w+) = reduce_scatter_comm\.allocate\(", source)
    return (allocations == ["reduce_scatter_input", "reduce_output"]
            and "reduce_output.copy_(reduce_scatter_input)" in source)


@functools.cache
def _one_rank_reduce_class():
    base = _find(f"{_FSDP}._fsdp_api.ReduceScatter")

    class OneRankReduceInPlace(base):
        """FSDP's reduce over a one-rank group is a copy of the gradient buffer it fills
        into a second buffer that becomes the sharded gradients, the whole buffer every
        backward (bench/one_rank_reduce.py; docs/benchmarks.md gives its figures). Handing
        the first buffer back as the second makes that copy one of a tensor onto itself,
        which torch skips; the values are the same, and the second buffer is never
        allocated."""

        def __init__(self) -> None:
            self.input_buffer = None
            self.aliased = 0  # for tests: reduces that skipped the copy

        def allocate(self, size, *, dtype, device) -> torch.Tensor:
            # Calls come in pairs within one foreach_reduce, the reduce's input then its
            # output (reduces_in_place checks); between the two FSDP only copies the
            # gradients in, so a pair is not split short of a crash of the step.
            if self.input_buffer is None:
                self.input_buffer = torch.empty(size, dtype=dtype, device=device)
                return self.input_buffer
            buffer, self.input_buffer = self.input_buffer, None
            if tuple(buffer.shape) == tuple(size) and buffer.dtype == dtype:
                self.aliased += 1
                return buffer
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            raise AssertionError(f"a reduce-scatter over {group.size()} ranks reached the one-rank reduce")

    return OneRankReduceInPlace


def reduce_in_place(module: nn.Module) -> object:
    """Install the in-place reduce on the FSDP unit `module`, whose reduce-scatter group is
    one rank (the caller checks that, and reduces_in_place()); returns the comm."""
    comm = _one_rank_reduce_class()()
    module.set_custom_reduce_scatter(comm)
    return comm
