"""Integer `reshard_after_forward`: after forward, keep each parameter sharded over a
group of k ranks (the intra-node group) instead of the whole shard group, so the
backward all-gather stays on the fast links.

torch 2.13 cannot do this on the dp sub-mesh of a (dp, tp) mesh by itself:
fully_shard builds the post-forward DeviceMesh from the calling rank's own dp row,
so ranks with different tp coordinates issue different `new_group` calls and hang;
and FSDP refuses to reshard TP (DTensor) parameters onto a smaller mesh. So the
engine builds the post-forward mesh once, the same way on every rank, as
(groups, k, tp) over the whole world, and installs it on each FSDP parameter
group. TP parameters get a post-forward DTensor on that 3-D mesh with placements
(Replicate, <FSDP's shard placement>, <TP placement>).

This reaches into FSDP2 internals (FSDPParamGroup.post_forward_mesh_info and
FSDPParam's post-forward methods), checked on torch 2.13; `check_supported`
refuses up front, with a message, on a torch that lacks them.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from engine.errors import UserError
from parallel.mesh import MeshSpec, ParallelDims

POST_FORWARD_DIMS = ("post_replicate", "post_shard", "tp")


def resolve_reshard(setting, spec: MeshSpec, local_world_size: int | None = None) -> bool | int:
    """Turn the config value (true, false, an integer or "auto") into what FSDP takes.

    An integer k must divide the FSDP shard size (dp). k == dp is plain True, and
    k == 1 keeps the whole parameter, which is False. "auto" picks the ranks of the
    shard group that share a node: LOCAL_WORLD_SIZE / tp, since tp is innermost.
    """
    if isinstance(setting, bool):
        return setting
    if setting == "auto":
        per_node = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", spec.hsdp * spec.dp * spec.tp))
        setting = max(1, per_node // spec.tp)
        while spec.dp % setting:
            setting -= 1
        if setting == 1 and spec.dp > 1:
            return True  # no two shard ranks share a node: reshard fully
    if not isinstance(setting, int) or isinstance(setting, bool):
        raise UserError(f"parallel.reshard_after_forward is {setting!r}; use true, false, auto or an integer.")
    if setting < 1 or spec.dp % setting:
        divisors = [d for d in range(1, spec.dp + 1) if spec.dp % d == 0]
        raise UserError(
            f"parallel.reshard_after_forward={setting} must divide the FSDP shard size dp={spec.dp} "
            f"of --mesh {spec}: the parameters are resharded onto groups of that many ranks after "
            f"forward. Use one of {divisors}, true, false or auto.")
    if setting == spec.dp:
        return True
    if setting == 1:
        return False
    return setting


def check_supported() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    needed = [(_fsdp_param.FSDPParam, "_init_sharded_post_forward_param_metadata"),
              (_fsdp_param.FSDPParam, "to_sharded_post_forward"),
              (_fsdp_param_group.FSDPParamGroup, "_use_post_forward_mesh")]
    missing = [f"{cls.__name__}.{name}" for cls, name in needed if not hasattr(cls, name)]
    if missing:
        raise UserError(
            f"integer parallel.reshard_after_forward needs FSDP2 internals that torch "
            f"{torch.__version__} does not have ({', '.join(missing)}). Use "
            f"parallel.reshard_after_forward=true (or false) on this torch.")


def build_post_forward_mesh(dims: ParallelDims, k: int) -> DeviceMesh:
    """(hsdp*dp/k, k, tp) over the whole world, built identically on every rank.
    Rank order matches (hsdp, dp, tp), so each post_shard row is k consecutive
    members of one FSDP shard group."""
    spec = dims.spec
    return init_device_mesh(dims.device_type, (spec.hsdp * spec.dp // k, k, spec.tp),
                            mesh_dim_names=POST_FORWARD_DIMS)


def _post_forward_dtensor(fsdp_param, local: torch.Tensor, post_mesh: DeviceMesh) -> DTensor:
    """The post-forward parameter of a TP parameter: FSDP's shard placement now spans k
    ranks, the TP placement is unchanged."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    sharded = fsdp_param._sharding_spec
    placements = (Replicate(), sharded.placements[-2], sharded.placements[-1])
    return _from_local_no_grad(local, DTensorSpec(post_mesh, placements, tensor_meta=sharded.tensor_meta))


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
    reshard onto `post_mesh`'s post_shard groups after forward."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
    info = HSDPMeshInfo(post_mesh["post_replicate", "post_shard"], shard_mesh_dim=1, replicate_mesh_dim=0)
    for group in module._get_fsdp_state()._fsdp_param_groups:
        group.post_forward_mesh_info = info
        for fsdp_param in group.fsdp_params:
            fsdp_param.post_forward_mesh_info = info
            fsdp_param._init_sharded_post_forward_param_metadata(
                torch.empty(fsdp_param._orig_size, device="meta"))
            if fsdp_param.is_dtensor:
                base = type(fsdp_param)
                fsdp_param.__class__ = _CLASSES.setdefault(base, _tp_aware_param_class(base))
                fsdp_param._post_forward_world_mesh = post_mesh
