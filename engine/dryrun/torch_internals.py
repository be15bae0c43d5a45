"""Every private torch name the dry run uses, checked once, up front.

The dry run follows the real code path under three pieces of torch that have no
public home: the fake process group (collectives that return at once, for any world
size), fake tensors (shapes and dtypes without storage), and the FSDP memory tracker
of torch.distributed._tools, with DTensor's sharding propagator so that the tracker
counts only the step's own tensors. A real run measured against it (gloo, on the
CPU) also needs c10d's Work. `check_supported()` imports what each needs, so a torch
that moved one fails before anything runs, with the name of what is missing.
"""

from __future__ import annotations

import importlib

from engine.errors import UserError

NEEDED = (
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"),  # registers the "fake" backend
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"),
    ("torch._C._distributed_c10d", "ProcessGroup"),
    ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator"),
)
NEEDED_ATTRIBUTES = (("torch._C._distributed_c10d", "ProcessGroup", "unbox"),
                     ("torch.distributed.tensor._sharding_prop", "ShardingPropagator",
                      "_propagate_tensor_meta_non_cached"))
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


def start_fake_world(world_size: int, rank: int) -> None:
    """A default process group of `world_size` ranks in which this process is `rank` and
    every collective completes at once without moving data."""
    import torch.distributed as dist
    _load("torch.testing._internal.distributed.fake_pg", "FakeStore")
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)


def fake_tensor_mode():
    # Meta parameters become fake CPU tensors under to_empty, hence non-fake inputs.
    return _load("torch._subclasses.fake_tensor", "FakeTensorMode")(allow_non_fake_inputs=True)


def dispatch_mode_base():
    return _load("torch.utils._python_dispatch", "TorchDispatchMode")


# The tracker's own bookkeeping that `memory_tracker` relies on (see its docstring).
TRACKER_FIELDS = ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")


def memory_tracker(model, optimizer):
    """FSDPMemTracker, keeping only the step's peak and the peak of each phase (forward,
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
            return super().__enter__()

        def __exit__(self, *args) -> None:
            super().__exit__(*args)
            if self._depth == 0:
                self.stop_counting()

        def _update_peak_stats(self, peak_state) -> None:
            phase = self.phase_of() if self.phase_of else "forward"
            total = sum(snapshot["Total"] for snapshot in self._curr_mem_snap.values())
            self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), total)
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = deepcopy(snapshot)

    tracker = StepPeakTracker(model, optimizer)
    tracker.phase_peaks = {}
    missing = [name for name in (*TRACKER_FIELDS, "_update_peak_stats") if not hasattr(tracker, name)]
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


def storage_key(storage) -> int:
    """An identity for a storage that holds for meta and fake storages too, whose data
    pointers are all zero."""
    return storage._cdata
