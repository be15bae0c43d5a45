"""Distributed checkpoints (torch.distributed.checkpoint) of a training run, and resume.

A checkpoint holds the sharded model and optimizer (as DTensors keyed by
parameter name, so any mesh can load them), the LR scheduler, the step and each
rank's RNG states. The data position is the step itself: sample i of step s is
a pure function of (seed, s, i) (engine/data/sources.py), so it carries over to any
data-parallel size unchanged. On-disk layout and the all-or-nothing rules live
in engine/checkpoint/store.py.

With fault-tolerant replica groups (parallel/replicas.py) the step is the groups' common
count of committed steps, and each group's data position is its own: the first of the
step's live groups saves, into run.dir/checkpoints as always, and its meta.json records
every group's position and torchft's count, so that every group of a whole-job restart
starts from the same weights at its own position.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from engine.checkpoint import reader, store
from engine.checkpoint.export import export_full, import_full
from engine.checkpoint.reader import Unreadable, root_cause
from common.config import to_dict
from common.errors import UserError, raise_if_any_rank
from parallel.pipeline import sync_tied_weights, whole_model


# The optimizer's state and hyperparameters keyed by parameter name, one entry per
# parameter: under pipeline parallel each stage's ranks hold only their own parameters, and
# a per-group list of names would be one stage's list in the checkpoint. Keyed by name, any
# pp loads it.
OPTIMIZER_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


def _rng_state() -> tuple[bytes, bytes]:
    """(CPU, CUDA) generator states as plain bytes: DCP stores a tuple of bytes as one object
    per rank, where a tensor would count as replicated and keep only one rank's copy."""
    cuda = torch.cuda.get_rng_state().numpy().tobytes() if torch.cuda.is_available() else b""
    return torch.get_rng_state().numpy().tobytes(), cuda


def _set_rng_state(state: tuple[bytes, bytes]) -> None:
    cpu, cuda = state
    torch.set_rng_state(torch.frombuffer(bytearray(cpu), dtype=torch.uint8))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(cuda), dtype=torch.uint8))


def agreed(decide, group=None):
    """Rank 0's `decide()` on every rank, or the UserError it raised, raised on every rank:
    files read by each rank could differ between ranks (a save, a copy, a disk going bad)."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, decide())
        except UserError as err:
            box[0] = (False, str(err))
    dist.broadcast_object_list(box, src=0, group=group)
    decided, value = box[0]
    if not decided:
        raise UserError(value)
    return value


class Checkpointer:
    """Saves every `checkpoint.every` steps and at the end; resumes from `resume_from`
    (agreed on by every rank), or from an older checkpoint of the run when that one's
    data turns out unreadable."""

    def __init__(self, cfg, dims, log, resume_from: store.Resume | None):
        self.cfg = cfg
        self.dims = dims
        self.log = log
        self.resume_from = resume_from
        self.root = store.checkpoints_dir(cfg.run.dir)
        self.rank = dist.get_rank()
        # DCP's own collectives go through a gloo group: CPU objects on any backend, and an
        # async save's background thread never shares a group with the training step.
        self.group = dist.new_group(backend="gloo")
        self.pending = None  # (future, partial folder, meta) of an async save in flight
        self.model = self.optimizer = self.scheduler = None  # given by resume()
        # Replica groups take turns saving: each writes and cleans up its own partial folders
        self.writer = f"group-{dims.replicas.group}" if dims.replicas is not None else ""

    def _state(self, step: int, rng_owner: int) -> dict:
        """What a checkpoint holds; loading fills the same structure in place."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=OPTIMIZER_BY_NAME)
        return {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict(),
                "train": {"step": step}, "rng": {f"rank{rng_owner}": _rng_state()}}

    def resume(self, model, optimizer, scheduler) -> int:
        """Load the checkpoint (or the init_from weights) into place; returns the first step."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        if self.resume_from is None:
            if self.cfg.checkpoint.init_from:
                import_full(model, self.cfg.checkpoint.init_from)
                self.log.print(f"weights from {self.cfg.checkpoint.init_from} (optimizer, schedule "
                               f"and data start fresh at step 0)")
            return 0
        while True:
            chosen = self.resume_from
            try:
                step = self._load(chosen.folder, chosen.meta)
                break
            except Unreadable as err:
                if not chosen.fallback:
                    raise
                rest = store.Candidates(chosen.fallbacks, True, [*chosen.skipped, (str(chosen.folder), err.cause)])
                shapes = store.state_dict_shapes(whole_model(model))
                groups = self.dims.replicas.groups if self.dims.replicas is not None else 0
                self.resume_from = agreed(lambda: store.choose(rest, to_dict(self.cfg), shapes,
                                                               self.cfg.training.steps, groups), self.group)
        if chosen.skipped and self.rank == 0:
            kept = store.set_aside(self.root, chosen.skipped, chosen.folder)
            self.log.print(f"warning: {'; '.join(why for _, why in chosen.skipped)}; resumed from {chosen.folder} "
                           f"instead, the newest checkpoint of this run that reads (kept "
                           f"{', '.join(kept) or 'everything'} as it was; nothing was deleted)")
        return step

    def _load(self, folder: Path, meta: dict) -> int:
        """Load one checkpoint into the model, optimizer, scheduler and RNG; returns its step."""
        model, optimizer, scheduler = self.model, self.optimizer, self.scheduler
        same_world = meta["world_size"] == dist.get_world_size()
        # With another world size, rank numbers no longer name the same work: all take rank 0's.
        rng_owner = self.rank if same_world else 0
        state = self._state(0, rng_owner)
        reader.load(state, folder, self.group)
        step, problem = state["train"]["step"], None
        try:  # values of the right types can still be wrong (an RNG state of another size), and each
            # rank applies its own: the ranks agree on whether all of them could
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=OPTIMIZER_BY_NAME)
            sync_tied_weights(model)
            scheduler.load_state_dict(state["scheduler"])
            _set_rng_state(state["rng"][f"rank{rng_owner}"])
            if step != meta["step"]:
                raise ValueError(f"its data is at step {step} and its {store.META} at step {meta['step']}")
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as err:
            problem = f"checkpoint {str(folder)!r} cannot be read: rank {self.rank}: {type(err).__name__}: {err}"
        raise_if_any_rank(problem, self.group, Unreadable)
        saved_data, data = meta["data_size"], self.dims.data_size
        carried = ("same data-parallel size" if saved_data == data else
                   f"data-parallel size {saved_data} -> {data}: each data rank builds its own rows of "
                   f"global batch {step}, so nothing is converted")
        rng = ("each rank's own" if same_world else
               f"rank 0's on every rank, since the world size changed from {meta['world_size']}")
        replicas = self.dims.replicas
        positions = store.data_positions(meta, replicas.groups if replicas is not None else 0)
        position = positions[replicas.group] if replicas is not None else step
        if replicas is not None:
            replicas.restore(step, positions, meta.get("fault_tolerance", {}).get("batches_committed", step))
        where = (f"data position = step {step}" if positions == [step] * len(positions) else
                 f"each replica group's data position, global batches {positions}")
        self.log.print(f"resumed from {folder} (saved on mesh {meta['mesh']}) after {step} steps; "
                       f"{where}, since sample i of step s depends only on "
                       f"(seed, s, i) ({carried}); RNG states: {rng}")
        if position == self.cfg.training.steps:
            self.log.print(f"the checkpoint already reaches training.steps={position}: nothing to train. "
                           f"Raise training.steps to continue, or use a new run.dir.")
        return step

    def step_finished(self, step: int) -> None:
        """Called after step index `step` (with replica groups, this group's data position
        before the step); saves when a checkpoint is due."""
        done, every, last = step + 1, self.cfg.checkpoint.every, step + 1 == self.cfg.training.steps
        replicas = self.dims.replicas
        if replicas is not None:
            if not replicas.leads:
                return
            done = replicas.step
        if every and (done % every == 0 or last):
            self.save(done)

    @property
    def exports(self) -> bool:
        """Whether this run writes the exports at the end: with replica groups, only the first
        of the last step's live groups (the others have the same weights)."""
        return self.dims.replicas is None or self.dims.replicas.leads

    def last_complete(self) -> Path | None:
        """The newest checkpoint that finished saving (what `latest` names)."""
        return store.latest(self.root)

    def _meta(self, step: int) -> dict:
        replicas = self.dims.replicas
        # With replica groups this job's mesh is one group's (hsdp=1): the mesh saved is the whole
        mesh = self.dims.spec if replicas is None else replace(self.dims.spec, hsdp=replicas.groups)
        meta = {"step": step, "mesh": str(mesh), "world_size": dist.get_world_size(),
                "data_size": self.dims.data_size, "data_position": {"step": step},
                "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "torch": torch.__version__, "state_dict": store.state_dict_shapes(whole_model(self.model)),
                "config": to_dict(self.cfg)}
        if replicas is not None:
            meta["fault_tolerance"] = {"groups": replicas.groups, "positions": list(replicas.positions),
                                       "batches_committed": replicas.manager.batches_committed(),
                                       "saved_by_group": replicas.group}
        return meta

    def save(self, step: int) -> None:
        self.wait()
        partial = store.partial_folder(self.root, step, self.writer)
        if self.rank == 0 and partial.exists():
            shutil.rmtree(partial)  # left by a crash during an earlier attempt at this step
        dist.barrier(group=self.group)
        state = self._state(step, self.rank)
        meta = self._meta(step)
        try:
            if self.cfg.checkpoint.async_save:
                future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
                self.pending = (future, partial, meta)
                return
            dcp.save(state, checkpoint_id=str(partial), process_group=self.group)
        except (CheckpointException, OSError) as err:
            self._failed(partial, step, err)
        self._commit(partial, meta)

    def wait(self) -> None:
        """Finish the async save in flight, if any, and make it the latest checkpoint."""
        if self.pending is None:
            return
        future, partial, meta = self.pending
        self.pending = None
        try:
            future.result()
        except (CheckpointException, OSError) as err:
            self._failed(partial, meta["step"], err)
        self._commit(partial, meta)

    def _commit(self, partial: Path, meta: dict) -> None:
        if self.rank == 0:
            final = store.commit(partial, meta, self.cfg.checkpoint.keep, self.writer)
            self.log.print(f"checkpoint step {meta['step']} -> {final}")

    def _failed(self, partial: Path, step: int, err: BaseException) -> NoReturn:
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # give back the space a full disk needs
        latest = store.latest(self.root)
        raise UserError(f"saving the checkpoint of step {step} to {str(partial)!r} failed "
                        f"({root_cause(err)}). The last complete checkpoint "
                        f"({latest or 'none yet'}) is untouched; free space or fix the folder, "
                        f"then resume with --resume.") from None

    def close(self) -> None:
        """At the end of training: wait for an async save, then write the export if asked."""
        self.wait()
        if self.cfg.checkpoint.export and self.exports:
            export_full(self.model, self.cfg.checkpoint.export)
            self.log.print(f"exported full weights -> {self.cfg.checkpoint.export}")
