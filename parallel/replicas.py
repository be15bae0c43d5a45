"""hsdp's replica groups as separate jobs that survive each other's failures (torchft).

With fault_tolerance.enabled, `--mesh hsdp=N,...` is N torchrun jobs, one per replica
group, each with the rest of the mesh (pp, dp, cp, tp) inside it. Inside a group,
FSDP shards over dp as without hsdp. Across groups, each FSDP module's reduce-scattered
gradient is averaged through torchft's managed process group: a group that dies makes
the step's average fail, the others do not commit that step, and they go on without it
from the next step. A group started again heals: torchft copies the model, optimizer and
schedule from a live group before its first step (sync quorum, so no batch is zeroed).

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


def check_fault_tolerance(cfg, spec, plan_names_experts: bool) -> None:
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
    if plan_names_experts:
        raise UserError("fault_tolerance.enabled=true does not take a mixture of experts yet: the router's "
                        "balance and the experts' groups are not carried across replica groups. Train it "
                        "with plain hsdp (fault_tolerance.enabled=false).")
    if cfg.checkpoint.every or cfg.checkpoint.resume == "always" or cfg.checkpoint.init_from:
        raise UserError("fault_tolerance.enabled=true does not save or resume checkpoints yet: a group that "
                        "fails heals from a live group instead. Set checkpoint.every=0 and "
                        "checkpoint.resume=auto, without checkpoint.init_from.")


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
        self.position_file = Path(run_dir) / "data_position.json"

    # What a healing group receives: set by `keep` once the optimizer exists.
    def keep(self, model, optimizer, scheduler) -> None:
        self._state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}

    def _save(self) -> dict:
        return {name: part.state_dict() for name, part in self._state.items()}

    def _load(self, state: dict) -> None:
        for name, part in self._state.items():
            part.load_state_dict(state[name])

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

    def add_up(self, tensor) -> int:
        """`tensor` summed in place over the step's live groups; returns how many took part."""
        import torch.distributed as dist
        self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()
        return self.manager.num_participants()

    def commit(self) -> bool:
        """Whether every live group finished the step: only then may the optimizer step."""
        return self.manager.should_commit()

    @property
    def step(self) -> int:
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def data_position(self) -> int:
        """The global batches this group has committed: its own, kept across its restarts
        (fault_tolerance.rejoin), 0 on a fresh start."""
        if not self.rejoin or not self.position_file.exists():
            return 0
        return int(json.loads(self.position_file.read_text())["position"])

    def save_position(self, position: int) -> None:
        """After each committed step, on the group's rank 0; written whole (rename), so a kill
        mid-write leaves the previous position."""
        partial = self.position_file.with_suffix(".partial")
        partial.write_text(json.dumps({"position": position, "step": self.step}))
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
