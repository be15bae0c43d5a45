"""hsdp's replica groups as separate jobs that survive each other's failures (torchft).

With fault_tolerance.enabled, `--mesh hsdp=N,...` is N torchrun jobs, one per replica
group, each with the rest of the mesh (pp, dp, cp, tp) inside it. Inside a group,
FSDP shards over dp as without hsdp. Across groups, each FSDP module's reduce-scattered
gradient is averaged through torchft's managed process group: a group that dies makes
the step's average fail, the others do not commit that step, and they go on without it
from the next step. A group started again heals: torchft copies the model, optimizer and
schedule from a live group before its first step (sync quorum, so no batch is zeroed).

Each group reads its own rows of each global batch, and counts the batches it has
committed: its data position. A group that was down falls behind the others, so the
positions differ; every group keeps every group's position (sent with the loss each step,
and with the state a healing group receives), and a checkpoint records them all, so that a
whole-job restart starts each group where it stopped (engine/checkpoint/dcp.py).

torchft (pip install -e .[ft]) is imported here only; the rest of the engine sees a
`Replicas` on ParallelDims, or None.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

from common.errors import UserError

INSTALL = "pip install -e .[ft]  (or pip install torchft)"
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"


def import_torchft():
    """torchft, its Rust side's logging at warnings: at INFO it prints every quorum and commit.
    Its logger reads RUST_LOG once, when the module is first imported."""
    os.environ.setdefault("RUST_LOG", "warn")
    import torchft
    return torchft


def lighthouse_address(ft) -> str:
    return ft.lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE, "")


def check_fault_tolerance(cfg, spec) -> None:
    """Everything about fault_tolerance.* that can be checked before any process starts."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return
    try:
        import_torchft()
    except ImportError:
        raise UserError(f"fault_tolerance.enabled=true needs torchft, which is not installed. Install it with "
                        f"`{INSTALL}`, or leave fault tolerance off.") from None
    if spec.hsdp < 2:
        raise UserError(f"fault_tolerance.enabled=true makes hsdp's replica groups survive each other's failures, "
                        f"but --mesh {spec} has no hsdp dimension (hsdp={spec.hsdp}). Give at least two "
                        f"replica groups, for example --mesh hsdp=2,dp=2.")
    if ft.group >= spec.hsdp:
        raise UserError(f"fault_tolerance.group={ft.group} is not a replica group of --mesh {spec}: groups are "
                        f"numbered 0 to {spec.hsdp - 1}.")
    if ft.min_groups > spec.hsdp:
        raise UserError(f"fault_tolerance.min_groups={ft.min_groups} is more than the {spec.hsdp} replica groups "
                        f"of --mesh {spec}, so no step could commit. Use at most {spec.hsdp}.")


def check_lighthouse(ft) -> str:
    """The Lighthouse's address, checked to answer (a plain TCP connect): a group that
    cannot reach it would wait in its first quorum until quorum_timeout_s."""
    address = lighthouse_address(ft)
    if not address:
        raise UserError(f"fault_tolerance.enabled=true needs the torchft Lighthouse's address: set "
                        f"fault_tolerance.lighthouse=http://HOST:PORT or {LIGHTHOUSE_VARIABLE}. Without "
                        f"either, `python launch/run.py` (no torchrun) starts one on this machine with "
                        f"every replica group.")
    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None:
        raise UserError(f"fault_tolerance.lighthouse={address!r} is not an address of the form http://HOST:PORT.")
    try:
        with socket.create_connection((parsed.hostname, port), timeout=5):
            pass
    except OSError as err:
        raise UserError(f"the torchft Lighthouse at {address} does not answer ({err.strerror or err}). Start it "
                        f"first (torchft_lighthouse --min_replicas 1 --bind [::]:{port}), or fix "
                        f"fault_tolerance.lighthouse.") from None
    return f"{parsed.scheme or 'http'}://{parsed.hostname}:{port}"


class Replicas:
    """This group's torchft Manager and what the loop asks of it."""

    def __init__(self, ft, groups: int, backend: str, run_dir: str):
        torchft = import_torchft()
        from torchft.process_group import ManagedProcessGroup, ProcessGroupGloo, ProcessGroupNCCL

        # A healing group reads the live group's tensors from read-only buffers; they are copied in
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        self.group, self.groups, self.rejoin = ft.group, groups, ft.rejoin
        timeout = timedelta(seconds=ft.timeout_s)
        across = ProcessGroupNCCL(timeout=timeout) if backend == "nccl" else ProcessGroupGloo(timeout=timeout)
        self._state: dict = {}
        self.manager = torchft.Manager(
            pg=across, min_replica_size=ft.min_groups, load_state_dict=self._load, state_dict=self._save,
            replica_id=f"meshtrain_{ft.group}", lighthouse_addr=check_lighthouse(ft), timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), use_async_quorum=False,
            quorum_retries=ft.quorum_retries)
        self.process_group = ManagedProcessGroup(self.manager)
        # The group's own files (step log, data position); checkpoints, common to all groups,
        # stay in run.dir.
        self.folder = Path(run_dir) / f"group-{ft.group}"
        self.position_file = self.folder / "data_position.json"
        self.positions = [0] * groups  # every group's committed global batches, as last known here
        self._sent = None  # the positions the step's groups sent with the loss (add_up)
        self.healed = False

    # What a healing group receives: set by `keep` once the optimizer exists.
    def keep(self, model, optimizer, scheduler) -> None:
        self._state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}

    def _save(self) -> dict:
        return {**{name: part.state_dict() for name, part in self._state.items()}, "positions": list(self.positions)}

    def _load(self, state: dict) -> None:
        for name, part in self._state.items():
            part.load_state_dict(state[name])
        self.positions = list(state["positions"])
        self.healed = True

    def restore(self, step: int, positions: list[int], batches_committed: int) -> None:
        """After loading a checkpoint of `step` committed steps: every group's position then,
        and torchft's own count, so that all groups restarted from it start at one step."""
        self.positions = list(positions)
        self.manager.load_state_dict({"step": step, "batches_committed": batches_committed})

    @property
    def position(self) -> int:
        """The global batches this group has committed: the next one it reads."""
        return self.positions[self.group]

    def average_gradients(self, module) -> None:
        """Every FSDP module of `module` averages its reduce-scattered gradients over the live
        groups (the step of parallel/apply.py that replaces hsdp's all-reduce)."""
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule

        def across_groups(gradient):
            dist.all_reduce(gradient, group=self.process_group, op=dist.ReduceOp.AVG)

        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_all_reduce_hook(across_groups)

    def start_step(self) -> None:
        """The quorum of live groups for the next step; a group behind them heals here."""
        self.manager.start_quorum()

    def add_up(self, tensor, with_position: bool = False) -> int:
        """`tensor` summed in place over the step's live groups, in float64; returns how many
        took part. `with_position` (the step's loss): each group's position after the step
        rides along (position + 1; 0 from a group that is not there), kept if the step
        commits."""
        import torch
        import torch.distributed as dist
        size = tensor.numel()
        both = torch.zeros(size + self.groups, dtype=torch.float64, device=tensor.device)
        both[:size] = tensor.flatten()
        if with_position:
            both[size + self.group] = self.position + 1
        self.manager.allreduce(both, reduce_op=dist.ReduceOp.SUM).wait()
        tensor.copy_(both[:size].view_as(tensor))
        if with_position:
            self._sent = [int(value) for value in both[size:].tolist()]
        return self.manager.num_participants()

    def commit(self) -> bool:
        """Whether every live group finished the step: only then may the optimizer step, and
        each group that took part has advanced by one batch."""
        committed = self.manager.should_commit()
        if committed and self._sent is not None:
            self.positions = [sent or kept for sent, kept in zip(self._sent, self.positions)]
        self._sent = None
        return committed

    @property
    def step(self) -> int:
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    @property
    def leads(self) -> bool:
        """Whether this group is the first of the step's live groups: the one that saves
        checkpoints and writes exports for all of them."""
        return self.manager.participating_rank() == 0

    def last_position(self) -> int:
        """The position this group's previous run last wrote (fault_tolerance.rejoin), 0 on a
        fresh start: a group started again that finds no live group to heal from had one."""
        if not self.rejoin or not self.position_file.exists():
            return 0
        return int(json.loads(self.position_file.read_text())["position"])

    def save_position(self) -> None:
        """After each committed step, on the group's rank 0; written whole (rename), so a kill
        mid-write leaves the previous position."""
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.position_file.with_suffix(".partial")
        partial.write_text(json.dumps({"position": self.position, "step": self.step}))
        os.replace(partial, self.position_file)
    @staticmethod
    def fingerprint(model) -> str:
        """The float64 sum and sum of squares of every parameter over the group's ranks, as hex:
        equal weights give equal text on every group (same layout, same order of sums)."""
        import torch
        import torch.distributed as dist
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for parameter in model.parameters():
                local = getattr(parameter, "_local_tensor", parameter).double()
                total += torch.stack([local.sum(), local.square().sum()])
        dist.all_reduce(total)
        return " ".join(value.hex() for value in total.tolist())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
