"""Every private torch name the dry run uses, checked once, up front.

The dry run follows the real code path under three pieces of torch that have no
public home: the fake process group (collectives that return at once, for any world
size), fake tensors (shapes and dtypes without storage), and the FSDP memory tracker
of torch.distributed._tools, with DTensor's sharding propagator so that the tracker
counts only the step's own tensors; a pipeline schedule's first-step warm-up, which
an observed step leaves out (pipeline_warmup_without_messages); autograd's own word on
whether a backward is running (in_autograd_backward); and, from torch 2.15, a pipeline
stage's rule for releasing sent outputs, which the dry run applies to fake tensors as a
real run does to real ones (fake_stage_outputs_released), and a schedule's message
posting, whose Works must keep what they send as a real group's do
(fake_messages_held_as_real_ones); and the module tracker's
gradient hooks, which must not keep a stage's received inputs alive
(_module_hooks_released_after_use). A real run measured against
it (gloo, on the CPU) also needs c10d's Work. A traced step (--trace) reads a DTensor's
local shard to count the FLOPs this rank runs (local_shape). `check_supported()`
imports what each needs, so a torch that moved one fails before anything runs, with the
name of what is missing.
"""

from __future__ import annotations

import importlib

from common.errors import UserError

NEEDED = (
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"),  # registers the "fake" backend
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch._subclasses.fake_tensor", "FakeTensor"),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"),
    ("torch._C._distributed_c10d", "ProcessGroup"),
    ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator"),
    ("torch.distributed.pipelining.schedules", "_batch_p2p"),  # fake_messages_held_as_real_ones
)
NEEDED_ATTRIBUTES = (("torch._C._distributed_c10d", "ProcessGroup", "unbox"),
                     ("torch._C", "_clear_DTensor_sharding_propagator_cache", "__call__"),
                     ("torch._C", "_current_graph_task_id", "__call__"),
                     ("torch.distributed.tensor._sharding_prop", "ShardingPropagator",
                      "_propagate_tensor_meta_non_cached"),
                     # The order of a rank's forwards and backwards (schedule_actions).
                     ("torch.distributed.pipelining.schedules", "Schedule1F1B", "_get_pipeline_order"),
                     ("torch.distributed.pipelining.schedules", "ScheduleInterleaved1F1B",
                      "_calculate_single_rank_operations"),
                     # The module tracker's gradient hooks (_module_hooks_released_after_use).
                     ("torch.distributed._tools.mod_tracker", "register_multi_grad_hook", "__call__"),
                     ("torch.autograd", "Variable", "_execution_engine"),
                     # A traced step's FLOPs on this rank's shard (local_shape).
                     ("torch.distributed.tensor", "DTensor", "_local_tensor"))
_MODULE_TRACKER = "torch.distributed._tools.mod_tracker"
# A pipeline schedule's warm-up (pipeline_warmup_without_messages): one of these, by version
# (2.13 and 2.14; 2.15; 2.11).
PIPELINE_WARMUP = (("torch.distributed.pipelining.schedules", "_PipelineSchedule", "_warmup_p2p"),
                   ("torch.distributed.pipelining.schedules", "_PipelineSchedule",
                    "_initialize_pipeline_distributed_state"),
                   ("torch.distributed.pipelining.stage", "_PipelineStageBase", "_get_init_p2p_neighbors_ops"))
# A stage that releases its outputs once sent (2.15: release_fwd_send_outputs) decides
# which by this method (fake_stage_outputs_released).
RELEASES_SENT_OUTPUTS = ("torch.distributed.pipelining.stage", "_PipelineStageBase", "release_fwd_send_outputs")
RELEASABLE_OUTPUT = ("torch.distributed.pipelining.stage", "_PipelineStageBase", "_output_slot_is_releasable")
# Only for a real run observed by the same code (record.isolated_collectives).
MEASURING = (("torch._C._distributed_c10d", "Work"), ("torch._C._distributed_c10d", "_create_work_from_future"))
MEASURING_ATTRIBUTES = (("torch._C._distributed_c10d", "Work", "unbox"),)


def _load(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def check_supported(measuring: bool = False) -> None:
    """Refuse, naming it, a torch without what the dry run (or, `measuring`, a real run
    observed like one) uses."""
    import torch
    names = NEEDED + (MEASURING if measuring else ())
    for module, name in names:
        try:
            _load(module, name)
        except (ImportError, AttributeError) as err:
            raise UserError(f"--dry-run needs {module}.{name}, which torch {torch.__version__} does not "
                            f"provide ({err}). The dry run is tested on torch 2.11 to 2.15.") from None
    for module, name, attribute in NEEDED_ATTRIBUTES + (MEASURING_ATTRIBUTES if measuring else ()):
        if not hasattr(_load(module, name), attribute):
            raise UserError(f"--dry-run needs {name}.{attribute}, which torch {torch.__version__} lacks.")
    if not any(hasattr(_load(module, name), attribute) for module, name, attribute in PIPELINE_WARMUP):
        raise UserError(f"--dry-run needs one of {', '.join(f'{n}.{a}' for _, n, a in PIPELINE_WARMUP)} to observe a "
                        f"pipeline step, and torch {torch.__version__} has none of them.")
    stage_class = _load(*RELEASES_SENT_OUTPUTS[:2])
    if hasattr(stage_class, RELEASES_SENT_OUTPUTS[2]) and not hasattr(stage_class, RELEASABLE_OUTPUT[2]):
        raise UserError(f"--dry-run needs _PipelineStageBase.{RELEASABLE_OUTPUT[2]} on a torch whose pipeline stages "
                        f"release their sent outputs, and torch {torch.__version__} lacks it.")


def start_fake_world(world_size: int, rank: int) -> None:
    """A default process group of `world_size` ranks in which this process is `rank` and
    every collective completes at once without moving data. DTensor's cached sharding
    decisions are dropped first: they hold the meshes of the world before, which compare
    equal to this one's and name its destroyed groups (a second simulated rank of the same
    layout, as under pipeline parallel, then failed with "Could not resolve the process
    group")."""
    import torch.distributed as dist
    _load("torch.testing._internal.distributed.fake_pg", "FakeStore")
    clear_sharding_cache()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)


def clear_sharding_cache() -> None:
    """Drop DTensor's cached sharding decisions, which keep the meshes they were made on: a
    later mesh that compares equal (same ranks, same dimension names) gets an earlier mesh's
    process groups. A process that builds one mesh after another needs this between them
    (tests/dryrun_worker.py: there a gradient's all-reduce ran on an earlier layout's ep group)."""
    import torch
    from torch.distributed.tensor import DTensor
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's copy


def fake_tensor_mode():
    # Meta parameters become fake CPU tensors under to_empty, hence non-fake inputs.
    return _load("torch._subclasses.fake_tensor", "FakeTensorMode")(allow_non_fake_inputs=True)


def in_autograd_backward() -> bool:
    """Whether autograd's engine is running a backward (a graph task) on this thread,
    however it was started: torch's own ModTracker.is_bw and FSDP ask the same. record.py
    labels collectives and memory by it where a pipeline stage's backward does not pass
    through torch.autograd.backward's torch-function handling (a GradientEdge root, torch
    2.15)."""
    import torch
    return torch._C._current_graph_task_id() != -1


def dispatch_mode_base():
    return _load("torch.utils._python_dispatch", "TorchDispatchMode")


# The tracker's own bookkeeping that `memory_tracker` relies on (see its docstring).
TRACKER_FIELDS = ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap", "_root_mod")


def memory_tracker(roots: list, optimizer):
    """FSDPMemTracker over the FSDP `roots` (the model, or each pipeline stage's part), keeping
    only the step's peak and the peak of each phase (forward,
    backward, optimizer). The stock tracker also updates a peak for every module on
    every op, by walking all modules tracked so far: at 405B (126 blocks) that walk is
    half of the dry run's time, and the report reads only these. The fields it keeps are checked, so a torch that renames them fails
    here and not with a wrong number."""
    from copy import deepcopy
    base = _load("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker")

    class StepPeakTracker(base):
        phase_peaks: dict = {}
        phase_of = None  # a callable naming the step's current phase, when given
        deriving = 0  # > 0 while DTensor runs an op only to learn its output's shape

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.deriving:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def __enter__(self):
            if self._depth == 0:
                self.stop_counting = _count_shape_propagation(self)
                self.stop_releasing = _module_hooks_released_after_use()
            return super().__enter__()

        def __exit__(self, *args) -> None:
            super().__exit__(*args)
            if self._depth == 0:
                self.stop_counting()
                self.stop_releasing()

        def _update_peak_stats(self, peak_state) -> None:
            # A meta tensor holds no memory (the whole model on meta, which a pipeline reads
            # its stages' shapes from, would otherwise count as one that is).
            devices = {device: snapshot for device, snapshot in self._curr_mem_snap.items() if device.type != "meta"}
            phase = self.phase_of() if self.phase_of else "forward"
            total = sum(snapshot["Total"] for snapshot in devices.values())
            self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), total)
            for device, snapshot in devices.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = deepcopy(snapshot)

    tracker = StepPeakTracker(roots[0], optimizer)
    tracker.phase_peaks = {}
    missing = [name for name in (*TRACKER_FIELDS, "_update_peak_stats") if not hasattr(tracker, name)]
    if len(roots) > 1 and "_root_mod" not in missing:
        # Several FSDP roots (the pipeline stages a rank holds): the tracker instruments what
        # its root module's modules() yields, so its root becomes a list of all of them.
        from torch import nn
        tracker._root_mod = nn.ModuleList(roots)
    if missing or not hasattr(base, "_update_peak_stats"):
        import torch
        raise UserError(f"--dry-run needs FSDPMemTracker's {', '.join(missing) or '_update_peak_stats'}, "
                        f"which torch {torch.__version__} does not have. The dry run is tested on torch "
                        f"2.11 to 2.15.")
    return tracker


def _count_shape_propagation(tracker):
    """Keep `tracker.deriving` above 0 while DTensor's sharding propagation runs an op on
    fake tensors to learn its output's shape and strides: those tensors are no memory of
    the step. A real run's propagation runs under a fake mode of its own, which the
    tracker ignores; the dry run's runs under the dry run's fake mode (torch's
    detect_fake_mode), so the tracker counted its outputs (1.25 MiB at the peak of dp=2,
    tp=2 sequence_parallel=true, 24 MiB at 100M). Returns the function that undoes this."""
    propagator = _load("torch.distributed.tensor._sharding_prop", "ShardingPropagator")
    propagate = propagator._propagate_tensor_meta_non_cached

    def counted(self, op_schema):
        tracker.deriving += 1
        try:
            return propagate(self, op_schema)
        finally:
            tracker.deriving -= 1

    propagator._propagate_tensor_meta_non_cached = counted
    return lambda: setattr(propagator, "_propagate_tensor_meta_non_cached", propagate)


def _module_hooks_released_after_use():
    """Have the tracker's module tracker remove each gradient hook it puts on a module's
    inputs once the hook has run, at the end of that backward. It never removes them, and
    a hook on a tensor that autograd accumulates into (a leaf that requires grad: a
    pipeline stage's received activations) holds that tensor's gradient accumulator,
    which holds the tensor: a cycle through C++ that Python's collector cannot break, so
    every micro-batch's received input outlived its backward in the observed step (113 x
    32 MiB at pp rank 1's peak of Llama 3 405B on 8,192 GPUs), which a run without the
    tracker lets go. Returns the function that undoes this."""
    module = importlib.import_module(_MODULE_TRACKER)
    register = module.register_multi_grad_hook
    engine = _load("torch.autograd", "Variable")._execution_engine

    def register_released(tensors, fn, **kwargs):
        handle = None

        def run_then_release(*args):
            fn(*args)
            engine.queue_callback(handle.remove)  # not while autograd walks the tensor's hooks

        handle = register(tensors, run_then_release, **kwargs)
        return handle

    module.register_multi_grad_hook = register_released
    return lambda: setattr(module, "register_multi_grad_hook", register)


_SCHEDULES = "torch.distributed.pipelining.schedules"


def schedule_actions(schedule: str, pp: int, per_rank: int, micro_batches: int, rank: int) -> list[tuple[int, str]]:
    """Pipeline rank `rank`'s forwards and backwards in one step, in order, each as (its
    local stage, "F" or "B"), for 1F1B or Interleaved1F1B: torch's own order, from the
    method each schedule computes it with, called on the numbers it reads, so that the
    search knows a step's order without building its stages. (Schedule1F1B steps through
    its own loop; _get_pipeline_order lists the same warm-up, steady and cool-down, as the
    search's tests against full simulations confirm.)"""
    from types import SimpleNamespace
    if schedule == "1F1B":
        numbers = SimpleNamespace(_num_stages=pp, _n_microbatches=micro_batches)
        order = _load(_SCHEDULES, "Schedule1F1B")._get_pipeline_order(numbers)[rank]
    else:
        rounds = max(1, micro_batches // pp)  # as ScheduleInterleaved1F1B.__init__ sets them
        numbers = SimpleNamespace(n_local_stages=per_rank, pp_group_size=pp, _n_microbatches=micro_batches,
                                  number_of_rounds=rounds, microbatches_per_round=micro_batches // rounds)
        order = _load(_SCHEDULES, "ScheduleInterleaved1F1B")._calculate_single_rank_operations(numbers, rank)
    return [(action.stage_index // pp, action.computation_type.value) for action in order
            if action is not None and action.computation_type.value in ("F", "B")]


def pipeline_warmup_without_messages():
    """A context in which a pipeline schedule's first step sends no warm-up messages, for
    an observed step (real or simulated) to count what every later step does. From torch
    2.13 a schedule's first step runs a vote over point-to-point messages that decides
    between static and inferred stage shapes; the engine gives every stage its shapes,
    so the vote always says static, and here each stage is told so directly (torch 2.14
    does the same by itself in a fake process group, whose messages carry nothing; 2.13
    fails there). Before 2.13 the first step exchanges a dummy message with each
    neighbour, which gloo and the fake backend do not need; here it is left out. torch 2.15
    moved the vote into _initialize_pipeline_distributed_state (an all-reduce over the
    pipeline group, then connections to each neighbour): also decided locally here, unless
    the stages use per-edge groups, which that method creates."""
    from contextlib import contextmanager
    from unittest import mock

    schedule_class = _load(_SCHEDULES, "_PipelineSchedule")

    @contextmanager
    def patched():
        if hasattr(schedule_class, "_warmup_p2p"):
            static = _load("torch.distributed.pipelining._utils", "InferenceMode").STATIC

            def decide_locally(self, stages, has_backward, p2p_done):
                for stage in stages:
                    stage._inference_mode = static

            with mock.patch.object(schedule_class, "_warmup_p2p", decide_locally):
                yield
        elif hasattr(schedule_class, "_initialize_pipeline_distributed_state"):
            static = _load("torch.distributed.pipelining._utils", "InferenceMode").STATIC
            original = schedule_class._initialize_pipeline_distributed_state

            def decide_without_messages(self, stages, has_backward, initialize_p2p):
                if any(getattr(stage, "p2p_per_edge", False) for stage in stages):
                    return original(self, stages, has_backward, initialize_p2p)
                for stage in stages:
                    stage._inference_mode = static

            with mock.patch.object(schedule_class, "_initialize_pipeline_distributed_state", decide_without_messages):
                yield
        else:
            stage_class = _load("torch.distributed.pipelining.stage", "_PipelineStageBase")
            with mock.patch.object(stage_class, "_get_init_p2p_neighbors_ops", lambda self: []):
                yield

    return patched()


def fake_stage_outputs_released():
    """A context in which a pipeline stage releases a FakeTensor output after its send, as
    it does the plain tensor that the FakeTensor stands for in a real run. From torch 2.15
    a stage drops its reference to an output once the output is sent, and later starts
    that micro-batch's backward from the output's GradientEdge, but only for an output
    whose type is exactly torch.Tensor (stage.py: _output_slot_is_releasable); a
    FakeTensor is not, so a simulated first stage of 1F1B held each micro-batch's output
    until its backward, 256 KiB (0.8%) above a real run's peak on pp=2,dp=2. Here the
    stage judges a plain meta tensor in the FakeTensor's place. Nothing before 2.15."""
    from contextlib import nullcontext
    from unittest import mock

    import torch
    module, name, method = RELEASABLE_OUTPUT
    stage_class = _load(module, name)
    judge = getattr(stage_class, method, None)
    if judge is None:  # before 2.15: a stage keeps its outputs until their backward
        return nullcontext()
    fake_class = _load("torch._subclasses.fake_tensor", "FakeTensor")
    with _load("torch._subclasses.fake_tensor", "unset_fake_temporarily")():
        plain = torch.empty(0, device="meta")

    def as_in_a_real_run(self, output):
        return judge(self, plain if type(output) is fake_class else output)

    return mock.patch.object(stage_class, method, as_in_a_real_run)


def fake_messages_held_as_real_ones():
    """A context in which each of a pipeline schedule's messages keeps its tensor for as
    long as its Work lives, as a real process group's Work does (seen on gloo), and the
    fake group's, which hold nothing, did not. Before torch 2.15 the looped schedules
    keep every send's Work until the step ends: the gradients a stage sends backward
    stayed in a real run and were missing from the prediction (the Interleaved1F1B row
    of bench/dryrun_validation.py: 21.58 MiB predicted, 21.96 measured).
    parallel/pipeline_internals.py lets go of the forward sends' Works at their
    micro-batch's backward in both runs alike; 2.15's schedules drop each Work once
    waited. Through the schedules module's `_batch_p2p`, by which every schedule posts."""
    from contextlib import contextmanager
    schedules = importlib.import_module(_SCHEDULES)

    class HeldWork:
        def __init__(self, work, tensors):
            self.work, self.tensors = work, tensors

        def wait(self, *args, **kwargs):
            return self.work.wait(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.work, name)

    @contextmanager
    def held():
        post = schedules._batch_p2p

        def post_holding(p2p_ops, *args, **kwargs):
            works = post(p2p_ops, *args, **kwargs)
            if len(works) == len(p2p_ops):  # one Work per message, each keeping its own tensor
                return [HeldWork(work, [op.tensor]) for work, op in zip(works, p2p_ops)]
            return [HeldWork(work, [op.tensor for op in p2p_ops]) for work in works]

        schedules._batch_p2p = post_holding
        try:
            yield
        finally:
            schedules._batch_p2p = post

    return held()


def unbox_work(boxed):
    """The c10d Work that a c10d op returns boxed."""
    return _load("torch._C._distributed_c10d", "Work").unbox(boxed)


def completed_work(tensors: list):
    """A Work, boxed as a c10d op returns one, that is already done, with `tensors` as its result."""
    import torch
    future = torch.futures.Future()
    future.set_result(tensors)
    return _load("torch._C._distributed_c10d", "_create_work_from_future")(future).boxed()


def group_name(process_group_argument) -> str:
    """The name of the process group a c10d op was called with (a boxed ScriptObject)."""
    return _load("torch._C._distributed_c10d", "ProcessGroup").unbox(process_group_argument).group_name


def group_ranks(name: str) -> tuple[int, ...]:
    """The global ranks of the process group registered under `name`, in order."""
    import torch.distributed as dist
    return tuple(dist.get_process_group_ranks(_load("torch.distributed.distributed_c10d",
                                                    "_resolve_process_group")(name)))


def local_shape(tensor):
    """The shape of this rank's part of a tensor: of a DTensor, its local shard's, read from
    the shard itself (to_local() is an autograd function, which a dispatch mode running
    below autograd would dispatch a view through)."""
    from torch.distributed.tensor import DTensor
    return tensor._local_tensor.shape if isinstance(tensor, DTensor) else tensor.shape


def storage_key(storage) -> int:
    """An identity for a storage that holds for meta and fake storages too, whose data
    pointers are all zero."""
    return storage._cdata
