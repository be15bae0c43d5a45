"""The `--mesh` text, its validation, and the named DeviceMesh built from it.

The grid has five named dimensions, outermost first:

    pp    pipeline stages, outermost: only activations cross it, point to point,
          so it is the one dimension that spans nodes cheaply
    hsdp  replica groups (HSDP replicates across them)
    dp    FSDP shard degree inside each replica group
    cp    context parallel degree: each rank holds a part of every sequence
          (parallel/context.py); FSDP shards parameters over dp x cp
    tp    tensor parallel degree, innermost so its ranks share a node

and `ep`, expert parallelism, which borrows its ranks from dp (parallel/expert.py):
`--mesh dp=4,ep=2` is 4 ranks whose experts are split in two. It multiplies nothing.

Parsing needs no process group, so it can be tested on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.errors import UserError

DIM_ORDER = ("pp", "hsdp", "dp", "cp", "tp")
BORROWED = ("ep",)  # dimensions that split dp's ranks again instead of adding ranks
_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(-?\d+)\s*$")
_EXAMPLE = "for example --mesh dp=4,tp=2 or --mesh pp=2,hsdp=2,dp=2,tp=2"


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of every dimension; a size of -1 means "the rest of the world"."""

    hsdp: int = 1
    dp: int = 1
    tp: int = 1
    # Added after (hsdp, dp, tp) so that positional (hsdp, dp, tp) stays valid; their
    # places in the mesh are DIM_ORDER's: pp outermost, cp third from the inside.
    cp: int = 1
    pp: int = 1
    ep: int = 1  # borrowed from dp: not in `sizes`

    @property
    def sizes(self) -> tuple[int, ...]:
        """In DIM_ORDER, outermost first."""
        return (self.pp, self.hsdp, self.dp, self.cp, self.tp)

    @property
    def world_size(self) -> int | None:
        """The number of ranks this mesh needs, or None while a -1 is unresolved."""
        if -1 in self.sizes:
            return None
        return self.pp * self.hsdp * self.dp * self.cp * self.tp

    @property
    def shard_size(self) -> int:
        """The ranks FSDP shards each parameter over: dp, and cp, whose ranks would
        otherwise hold the same parameters."""
        return self.dp * self.cp

    def resolve(self, world_size: int) -> "MeshSpec":
        """Replace a -1 by what is left of `world_size`, and check the product."""
        known = 1
        for size in self.sizes:
            if size != -1:
                known *= size
        if -1 in self.sizes:
            if world_size % known:
                raise UserError(
                    f"--mesh {self} cannot fill a world of {world_size} ranks: the fixed "
                    f"dimensions multiply to {known}, which does not divide {world_size}. "
                    f"Choose sizes whose product divides the world size."
                )
            return MeshSpec(ep=self.ep, **{name: world_size // known if size == -1 else size
                                           for name, size in zip(DIM_ORDER, self.sizes)})
        if known != world_size:
            raise UserError(
                f"--mesh {self} needs {known} ranks but the world size is {world_size}. "
                f"Make the product of the mesh sizes equal the number of processes "
                f"(torchrun --nproc_per_node, or --nproc), or use -1 for one dimension "
                f"to take the rest."
            )
        return self

    def __str__(self) -> str:
        return format_mesh(self)


def format_mesh(spec: MeshSpec) -> str:
    """Canonical text: every dimension larger than 1 (or -1), outermost first."""
    items = [f"{name}={size}" for name, size in zip(DIM_ORDER, spec.sizes) if size != 1]
    if spec.ep != 1:
        items.insert(sum(size != 1 for size in spec.sizes[:DIM_ORDER.index("dp") + 1]), f"ep={spec.ep}")
    return ",".join(items) or "dp=1"


def parse_mesh(text: str) -> MeshSpec:
    """Parse `dp=4,tp=2` style text. Raises UserError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"--mesh is empty. Give named sizes, {_EXAMPLE}.")
    sizes: dict[str, int] = {}
    for raw in text.split(","):
        match = _ITEM.match(raw)
        if match is None:
            raise UserError(
                f"--mesh {text!r}: cannot read {raw.strip()!r}. Each item must be "
                f"name=size with an integer size, {_EXAMPLE}."
            )
        name, size = match.group(1), int(match.group(2))
        if name not in DIM_ORDER + BORROWED:
            raise UserError(
                f"--mesh {text!r}: unknown dimension {name!r}. Known dimensions are "
                f"{', '.join(DIM_ORDER)} (outermost first), and ep (expert parallel, borrowed from dp)."
            )
        if name in sizes:
            raise UserError(f"--mesh {text!r}: dimension {name!r} is given twice. Give each once.")
        if size == 0 or size < -1:
            raise UserError(
                f"--mesh {text!r}: {name}={size} is not a valid size. Sizes are positive "
                f"integers, or -1 (at most once) for the rest of the world size."
            )
        if name in BORROWED and size == -1:
            raise UserError(f"--mesh {text!r}: {name} borrows its ranks from dp, so it cannot take the rest "
                            f"of the world (-1). Give it a size that divides dp.")
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise UserError(
            f"--mesh {text!r}: more than one dimension is -1. At most one may take the "
            f"rest of the world size."
        )
    return MeshSpec(**sizes)


@dataclass
class ParallelDims:
    """The built mesh and the views of it that the rest of the engine uses.

    `fsdp` is what fully_shard gets: 1-D (dp) or, with hsdp > 1, 2-D (hsdp, dp).
    With cp > 1 its shard dimension is dp x cp flattened (`dp_cp`), so cp ranks hold
    no duplicate parameters and gradients are averaged over them too.
    `tp` is the tensor-parallel sub-mesh, `cp` the context-parallel one, `pp` the
    pipeline one. `data` is hsdp x dp x cp flattened: each of its ranks holds different
    tokens of the global batch, and loss averages use its group. Ranks with the same
    `data_rank` (the hsdp x dp coordinate) read the same rows, each cp rank its own part
    of them, and every stage of one pipeline the same rows and parts.
    All of them are this rank's slice: with pp > 1 each stage has its own.
    """

    spec: MeshSpec
    device_type: str
    world: "DeviceMesh"  # noqa: F821 - torch is imported lazily
    fsdp: "DeviceMesh"  # noqa: F821
    tp: "DeviceMesh"  # noqa: F821
    data: "DeviceMesh"  # noqa: F821
    cp: "DeviceMesh"  # noqa: F821
    pp: "DeviceMesh"  # noqa: F821
    # With ep > 1 (parallel/expert.py), from a mesh of their own that splits dp into
    # (expert-dp, ep): the ep group, and what fully_shard gets for the experts, as `fsdp`
    # but over expert-dp x cp.
    ep: "DeviceMesh | None" = None  # noqa: F821
    expert_fsdp: "DeviceMesh | None" = None  # noqa: F821
    # With fault_tolerance.enabled (parallel/replicas.py), hsdp's groups are separate jobs:
    # this job's mesh has hsdp=1, and `replicas` averages gradients across the groups.
    replica_group: int = 0
    replica_groups: int = 1
    replicas: "Replicas | None" = None  # noqa: F821

    @property
    def tp_enabled(self) -> bool:
        return self.spec.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.spec.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.spec.pp > 1

    @property
    def data_rank(self) -> int:
        here = self.data.get_local_rank() // self.spec.cp  # cp is innermost in `data`
        return self.replica_group * self.spec.hsdp * self.spec.dp + here

    @property
    def cp_rank(self) -> int:
        return self.cp.get_local_rank()

    @property
    def cp_size(self) -> int:
        return self.spec.cp

    @property
    def data_size(self) -> int:
        return self.replica_groups * self.spec.hsdp * self.spec.dp


def build_mesh(spec: MeshSpec, device_type: str) -> ParallelDims:
    """Build the named 5-D DeviceMesh; the process group must already exist."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh(device_type, spec.sizes, mesh_dim_names=DIM_ORDER)
    data = world["hsdp", "dp", "cp"]._flatten("data")
    dims = ParallelDims(spec=spec, device_type=device_type, world=world, fsdp=_fsdp_mesh(world, data, spec, "dp"),
                        tp=world["tp"], data=data, cp=world["cp"], pp=world["pp"])
    if spec.ep > 1:
        experts = init_device_mesh(device_type, (spec.pp, spec.hsdp, spec.dp // spec.ep, spec.ep, spec.cp, spec.tp),
                                   mesh_dim_names=("pp", "hsdp", "edp", "ep", "cp", "tp"))
        expert_data = experts["hsdp", "edp", "cp"]._flatten("expert_data")
        dims.ep, dims.expert_fsdp = experts["ep"], _fsdp_mesh(experts, expert_data, spec, "edp")
    return dims


def _fsdp_mesh(world, data, spec: MeshSpec, shard: str):
    """What fully_shard gets: `shard` (dp, or the experts' edp), flattened with cp when
    cp > 1, after hsdp when hsdp > 1. `data` is hsdp x shard x cp flattened."""
    if spec.cp == 1:
        return world["hsdp", shard] if spec.hsdp > 1 else world[shard]
    if spec.hsdp == 1:
        return world[shard, "cp"]._flatten(f"{shard}_cp")
    # (hsdp, shard_cp): slicing a flattened dimension out of `world` is deprecated
    return data._unflatten(0, (spec.hsdp, data.size() // spec.hsdp), ("hsdp", f"{shard}_cp"))
