"""What one training step does on one rank: its collectives and its memory.

The same recorder watches a real run (tests/dryrun_worker.py, real tensors over gloo)
and a dry run (fake tensors, fake process group), so a prediction and a measurement
are counted by the same rules:

- a collective is one c10d or functional-collective op; its bytes are the size of the
  full buffer it produces or consumes: an all-gather's output, a reduce-scatter's
  input, an all-reduce's tensor;
- its mesh dimension is the one whose process group it ran on;
- its phase is `forward`, `backward` (anything under Tensor.backward or autograd's
  backward and grad, or while autograd's engine runs a backward, including FSDP's
  reduce-scatters, and a pipeline stage's gradient reduction after its last
  micro-batch) or `optimizer` (the loss mean, the gradient norm, the update);
  point-to-point messages between pipeline stages are `pipeline`;
- state bytes are the local shards' element counts times their element sizes.

Asked to (`--dry-run --trace`), it also keeps the step's order in a StepLog: each
collective as it is issued, and between them the FLOPs of the matmuls and attention
kernels this rank ran (engine/dryrun/trace.py lays them out on a timeline).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from unittest import mock

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from engine.dryrun import torch_internals
from parallel.mesh import DIM_ORDER

KINDS = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    # Point to point, between pipeline stages.
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}
# Point-to-point messages between pipeline stages go both ways all through the step
# (activations forward, their gradients back, micro-batch by micro-batch): their phase is
# "pipeline".
PHASES = ("forward", "backward", "optimizer", "pipeline")
POINT_TO_POINT = ("send", "recv")


def collective_kind(func) -> str | None:
    """The kind of collective an op is, or None for any other op."""
    return KINDS.get(func.overloadpacket.__name__) if func.namespace in ("c10d", "_c10d_functional") else None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def collective_bytes(kind: str, args) -> int:
    """The full buffer: an all-gather's output (c10d's first argument; a functional one,
    which TP's DTensors use, takes only its input and the group size), a reduce-scatter's
    input (its second for c10d and its first for functional ops), otherwise the tensor
    itself."""
    tensors = [a for a in args if isinstance(a, (torch.Tensor, list, tuple))]
    if kind in ("reduce_scatter", "all_gather") and len(tensors) >= 2:
        return max(_bytes(tensors[0]), _bytes(tensors[1]))
    if kind == "all_gather" and tensors:
        group_size = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), 1)
        return _bytes(tensors[0]) * group_size
    return _bytes(tensors[0]) if tensors else 0


def mesh_groups(dims) -> dict[tuple[int, ...], str]:
    """The ranks of each mesh dimension's group that holds this rank -> the dimension's name.
    A collective is labelled by its group's ranks, not its group's name: a process that
    builds several meshes (tests/dryrun_worker.py) gets new groups, with new names, for the
    same ranks, and torch reuses cached ones. Where two dimensions have the same ranks
    (dp and data without hsdp), the first named here wins. With cp, FSDP's shard group
    (dp x cp) comes first: with dp = 1 it has the cp group's ranks, and cp's own
    collectives are told apart by their group's name (named_groups)."""
    groups = {}
    if dims.spec.cp > 1:
        groups[torch_internals.group_ranks(dims.fsdp.get_group(dims.fsdp.ndim - 1).group_name)] = "dp_cp"
    for dim, size in zip(DIM_ORDER, dims.spec.sizes):
        if size > 1:
            groups.setdefault(torch_internals.group_ranks(dims.world.get_group(dim).group_name), dim)
    groups.setdefault(torch_internals.group_ranks(dims.data.get_group().group_name), "data")
    if dims.spec.pp > 2:  # a tied weight's first and last pipeline ranks (parallel/pipeline.py: _holder_group)
        stages = torch_internals.group_ranks(dims.world.get_group("pp").group_name)
        groups.setdefault((stages[0], stages[-1]), "pp_tie")
    return groups


def named_groups(dims) -> dict[str, str]:
    """Group name -> dimension, for the groups that another dimension's ranks may share:
    context parallel's attention traffic is its own even where FSDP's group has its ranks;
    so are expert parallel's all-to-alls (`ep`) and the FSDP of the experts over the data
    ranks that ep leaves (`edp`, or `edp_cp` with cp; parallel/mesh.py: ParallelDims.experts)."""
    names = {dims.cp.get_group().group_name: "cp"} if dims.spec.cp > 1 else {}
    if dims.ep is not None:
        names[dims.ep.get_group().group_name] = "ep"
        shard = dims.expert_fsdp.ndim - 1  # after hsdp, whose group is the world's
        if dims.expert_fsdp.size(shard) > 1:
            names[dims.expert_fsdp.get_group(shard).group_name] = "edp_cp" if dims.spec.cp > 1 else "edp"
    return names


# Group name -> dimension, for every mesh built in the current process group (its default
# group, the fake world of a dry run): see groups_named_in_this_world.
_NAMED_IN_WORLD: dict = {"world": None, "names": {}}


def _own_group_names(dims) -> set[str]:
    """The names of every group of this layout's meshes."""
    meshes = (dims.world, dims.fsdp, dims.data, dims.cp, dims.ep, dims.expert_fsdp)
    return {mesh.get_group(i).group_name for mesh in meshes if mesh is not None for i in range(mesh.ndim)}


def groups_named_in_this_world(dims) -> dict[str, str]:
    """named_groups of `dims`, and of every mesh given here before it in this world for the
    groups that `dims`'s meshes do not hold (the dry run gives each mesh it builds:
    simulate._rank_model). A search simulates layout after layout in one fake world and
    keeps DTensor's cached sharding decisions (simulate.enter_fake_world), which hold the
    meshes an earlier layout built: an op on a mesh equal to an earlier one's runs on the
    earlier mesh's groups, and without their names here a routing all-reduce over the
    experts' data ranks was named "group of 16", not edp (4 of 54 layouts of a Mixtral
    8x22B search on 128 GPUs). A group this layout holds is named by this layout alone:
    torch gives every layout the same default group for a dimension over the whole world,
    which an earlier layout's ep=world named ep, where a later dp=world's FSDP runs on it.
    Group names restart with each new world, so the names kept are the current world's only."""
    import torch.distributed as dist
    world = dist.group.WORLD
    if _NAMED_IN_WORLD["world"] is not world:
        _NAMED_IN_WORLD.update(world=world, names={})
    own = _own_group_names(dims)
    earlier = {name: dim for name, dim in _NAMED_IN_WORLD["names"].items() if name not in own}
    _NAMED_IN_WORLD["names"] = {**earlier, **named_groups(dims)}
    return dict(_NAMED_IN_WORLD["names"])


class _Phase(TorchFunctionMode):
    """`backward` inside Tensor.backward and inside autograd's own backward and grad, which
    a pipeline schedule calls for each micro-batch (the forward and backward of different
    micro-batches alternate), and wherever autograd's engine is running a backward on this
    thread; `forward` elsewhere until `optimizer()`.

    The engine's own word is needed because a torch-function mode does not see every
    backward: torch.autograd.backward offers itself to modes only when one of its roots is
    a tensor, and from torch 2.15 a pipeline stage releases a plain-tensor output once it
    is sent and starts that micro-batch's backward from the output's GradientEdge
    (stage.py: _output_slot_is_releasable, stage_backward). A real run's first stage did
    its FSDP pre-backward all-gathers there, unseen, so they were counted as forward; the
    dry run's stage output is a FakeTensor, which torch never releases, so its backward
    was seen."""

    BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)

    def __init__(self):
        super().__init__()
        self.marked = "forward"  # what the calls seen (and optimizer()) say
        self.depth = 0

    @property
    def phase(self) -> str:
        if self.marked == "forward" and torch_internals.in_autograd_backward():
            return "backward"
        return self.marked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in self.BACKWARD:
            return func(*args, **(kwargs or {}))
        self.enter_backward()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.leave_backward()

    def enter_backward(self) -> None:
        self.depth += 1
        self.marked = "backward"

    def leave_backward(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.marked = "forward"

    def optimizer(self) -> None:
        self.marked = "optimizer"


class CommTable:
    """count and bytes per (mesh dimension, phase, kind)."""

    def __init__(self):
        self.count = defaultdict(int)
        self.bytes = defaultdict(int)

    def add(self, dim: str, phase: str, kind: str, nbytes: int) -> None:
        self.count[dim, phase, kind] += 1
        self.bytes[dim, phase, kind] += nbytes

    def as_dict(self) -> dict:
        """{dim: {phase: {kind: {"count": n, "bytes": b}}}}, the JSON report's `comm`."""
        out: dict = {}
        for (dim, phase, kind), count in sorted(self.count.items()):
            out.setdefault(dim, {}).setdefault(phase, {})[kind] = {"count": count,
                                                                   "bytes": self.bytes[dim, phase, kind]}
        return out


@dataclass
class Compute:
    """FLOPs run between two collectives, within one phase."""
    phase: str
    flops: int


@dataclass
class Collective:
    """One collective, as issued: what CommTable adds up."""
    phase: str
    dim: str
    kind: str
    bytes: int


class StepLog:
    """One rank's step in the order it ran: Collective and Compute entries."""

    def __init__(self):
        self.events: list[Compute | Collective] = []

    def compute(self, phase: str, flops: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, Compute) and last.phase == phase:
            last.flops += flops
        else:
            self.events.append(Compute(phase, flops))

    def collective(self, phase: str, dim: str, kind: str, nbytes: int) -> None:
        self.events.append(Collective(phase, dim, kind, nbytes))


@functools.cache
def _flop_counts() -> dict:
    """Op -> a function of its arguments that gives the FLOPs this rank runs in it, by
    torch's own formulas (torch.utils.flop_counter). The dry run's fake tensors live on the
    CPU, where attention runs the CPU flash kernels; those have no formula of their own,
    and take the same leading arguments (the output's gradient first, in backward; then
    query, key and value) as the CUDA flash kernels whose formulas they borrow."""
    from torch.utils.flop_counter import flop_registry
    aten = torch.ops.aten
    counts = {op: _matmul(flop_registry[op]) for op in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)}
    counts[aten._scaled_dot_product_flash_attention_for_cpu] = _attention(
        flop_registry[aten._scaled_dot_product_flash_attention], leading=0)
    counts[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _attention(
        flop_registry[aten._scaled_dot_product_flash_attention_backward], leading=1)
    return counts


def _matmul(formula):
    def count(args) -> int:
        return formula(*(torch_internals.local_shape(a) if isinstance(a, torch.Tensor) else a for a in args))
    return count


def _attention(formula, leading: int):
    """`leading`: the arguments before the query. Key and value are counted with the
    query's heads: under grouped-query attention each of their heads serves several query
    heads, and the kernel multiplies by it once for each."""
    def count(args) -> int:
        shapes = [torch_internals.local_shape(a) for a in args[:leading + 3]]
        heads = shapes[leading][1]
        key, value = ((shape[0], heads, *shape[2:]) for shape in shapes[leading + 1:])
        return formula(*shapes[:leading + 1], key, value)
    return count


def matmul_flops(func, args) -> int:
    """The FLOPs of a matmul or attention op on this rank's tensors (a DTensor's local
    shard: the op DTensor runs on it), 0 for any other op, and for one on meta tensors:
    that is shape inference (a pipeline runs the whole model's head on meta to learn its
    logits' shape), not the step's work."""
    count = _flop_counts().get(func.overloadpacket)
    return count(args) if count and args[0].device.type != "meta" else 0


def _recorder_class():
    base = torch_internals.dispatch_mode_base()

    class Recorder(base):
        def __init__(self, phase: _Phase, groups: dict[tuple[int, ...], str], table: CommTable, fake: bool,
                     names: dict[str, str]):
            super().__init__()
            self.phase, self.groups, self.table, self.fake = phase, groups, table, fake
            self.dim_of_name: dict[str, str] = dict(names)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if self.fake and func is torch.ops.aten._local_scalar_dense.default:
                return 1.0  # a fake tensor has no value: the dry run reads every scalar (loss, norm) as 1
            kind = collective_kind(func)
            if kind is not None:
                phase = "pipeline" if kind in POINT_TO_POINT else self.phase.phase
                self.count(phase, self._dim(args, kwargs), kind, collective_bytes(kind, args))
            return func(*args, **kwargs)

        def count(self, phase: str, dim: str, kind: str, nbytes: int) -> None:
            self.table.add(dim, phase, kind, nbytes)

        def _dim(self, args, kwargs) -> str:
            # c10d ops take the group as a boxed ScriptObject; functional collectives take
            # its name as their last string argument (an earlier one is the reduce op).
            values = (*args, *kwargs.values())
            strings = [v for v in values if isinstance(v, str)]
            name = next((torch_internals.group_name(v) for v in values if isinstance(v, torch.ScriptObject)),
                        strings[-1] if strings else None)
            if name is None:
                return "other"
            if name not in self.dim_of_name:
                ranks = torch_internals.group_ranks(name)
                self.dim_of_name[name] = self.groups.get(ranks, f"group of {len(ranks)}")
            return self.dim_of_name[name]

    class TracingRecorder(Recorder):
        """A Recorder that also logs the step's order (StepLog); its own class, so that a
        step that is not traced looks at no op's FLOPs."""

        def __init__(self, *args, log: StepLog):
            super().__init__(*args)
            self.log = log

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flops = matmul_flops(func, args)
            if flops:
                self.log.compute(self.phase.phase, flops)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def count(self, phase: str, dim: str, kind: str, nbytes: int) -> None:
            super().count(phase, dim, kind, nbytes)
            self.log.collective(phase, dim, kind, nbytes)

    return Recorder, TracingRecorder


def _isolation_class():
    base = torch_internals.dispatch_mode_base()

    class Isolated(base):
        """Under the memory tracker in a real run: each collective runs to completion on
        untracked copies of its tensors, its results are copied back, and the caller gets a
        Work that is already done. Two things of gloo's reached the tracker otherwise. A
        reduce-scatter's Work keeps a copy of its whole input, which its wait() splits
        through the dispatcher, so the tracker counted it, a real-run-only temporary (96 MiB
        at the peak of 100M dp=4). And gloo's worker thread holds a finished collective's
        tensors until it next takes its queue's lock: when the step had already dropped
        them, they were freed on that thread, at a moment that varied from run to run (dp=4
        reshard_after_forward=2 peaked at 33.72 or 35.97 MiB). The dry run's fake
        collectives hold nothing. Ops run here pass no mode."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # Point-to-point messages pass as they are: a pipeline schedule posts a send and
            # a receive together and waits for both, which waiting on each would deadlock.
            if collective_kind(func) in (None, *POINT_TO_POINT):
                return func(*args, **kwargs)
            originals = {}  # id(copy) -> (copy, original)

            def copy(tensor):
                duplicate = tensor.clone()
                originals[id(duplicate)] = (duplicate, tensor)
                return duplicate

            copied_args, copied_kwargs = tree_map_only(torch.Tensor, copy, (args, kwargs))
            result = func(*copied_args, **copied_kwargs)
            _wait(result)
            # c10d names outputs first, and an all-gather's input may be a view of its output:
            # copied back last to first, the outputs win.
            for duplicate, original in reversed(originals.values()):
                original.copy_(duplicate)
            # A functional collective's new output is copied as well, since gloo holds it.
            result = tree_map_only(torch.Tensor, lambda t: originals[id(t)][1] if id(t) in originals else t.clone(),
                                   result)
            return tree_map_only(torch.ScriptObject, lambda _: torch_internals.completed_work(_tensor_list(result)),
                                 result)

    return Isolated


def _wait(result) -> None:
    """Wait for a c10d op's Work, and for a functional collective's outputs."""
    tree_map_only(torch.ScriptObject, lambda work: torch_internals.unbox_work(work).wait(), result)
    tree_map_only(torch.Tensor, torch.ops._c10d_functional.wait_tensor, result)


def _tensor_list(result) -> list:
    return [value for value in tree_leaves(result) if isinstance(value, torch.Tensor)]


def isolated_collectives(fake: bool, device: torch.device):
    """Entered before the memory tracker: for a real run over gloo (on the CPU), collectives
    that hold nothing once they return (see _isolation_class). Not on a GPU, where the
    copies would count in the allocator's own peak."""
    if fake or device.type != "cpu":
        return nullcontext()
    torch_internals.check_supported(measuring=True)
    return _isolation_class()()


@contextmanager
def recording(dims, table: CommTable, fake: bool, log: StepLog | None = None):
    """Count the collectives run inside (and with `log`, log the step's order); yields the
    phase tracker (`.phase`, and `.optimizer()` to mark the optimizer phase)."""
    from torch.distributed.pipelining import PipelineStage

    phase = _Phase()
    reduce_grad = PipelineStage.perform_reduce_grad

    def in_backward(stage, *args, **kwargs):
        # A pipeline stage reduces its gradients (FSDP's reduce-scatters) after the last
        # micro-batch's backward, outside autograd: still the backward's work.
        phase.enter_backward()
        try:
            return reduce_grad(stage, *args, **kwargs)
        finally:
            phase.leave_backward()

    with ExitStack() as stack:
        stack.enter_context(phase)
        recorder, tracing = _recorder_class()
        watch = (phase, mesh_groups(dims), table, fake, groups_named_in_this_world(dims))
        stack.enter_context(recorder(*watch) if log is None else tracing(*watch, log=log))
        stack.enter_context(mock.patch.object(PipelineStage, "perform_reduce_grad", in_backward))
        yield phase


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind these (local shards of) tensors: FSDP keeps
    each shard in a padded buffer, and its gradients as views of one buffer per group."""
    seen = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[torch_internals.storage_key(storage)] = storage.nbytes()
    return sum(seen.values())


def param_bytes(model) -> int:
    return storage_bytes(model.parameters())


def grad_bytes(model) -> int:
    return storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_bytes(optimizer) -> int:
    return storage_bytes(value for state in optimizer.state.values() for value in state.values()
                         if isinstance(value, torch.Tensor))
