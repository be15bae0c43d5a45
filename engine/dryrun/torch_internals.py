"""Every private torch name the dry run uses, checked once, up front.

The dry run follows the real code path under three pieces of torch that have no
public home: the fake process group (collectives that return at once, for any world
size), fake tensors (shapes and dtypes without storage), and the FSDP memory tracker
of torch.distributed._tools. `check_supported()` imports them all, so a torch that
moved one fails before anything runs, with the name of what is missing.
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
)


def _load(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def check_supported() -> None:
    import torch
    for module, name in NEEDED:
        try:
            _load(module, name)
        except (ImportError, AttributeError) as err:
            raise UserError(f"--dry-run needs {module}.{name}, which torch {torch.__version__} does not "
                            f"provide ({err}). The dry run is tested on torch 2.11 to 2.15.") from None
    if not hasattr(_load("torch._C._distributed_c10d", "ProcessGroup"), "unbox"):
        raise UserError(f"--dry-run needs ProcessGroup.unbox, which torch {torch.__version__} lacks.")


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
