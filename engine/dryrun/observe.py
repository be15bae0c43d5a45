"""One observed training step, the same for a real run and a dry run: the engine's own
train_step, with the collectives counted and the tensor memory tracked (record.py)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from engine.data.sources import rows_per_data_rank
from engine.dryrun import record, torch_internals
from engine.train import build_optimizer, train_step
from parallel.context import shapes_only
from parallel.pipeline import parts_of

# FSDPMemTracker's categories, folded into the report's.
MEMORY_PARTS = {
    "Sharded Param": "parameters", "Buffer": "parameters",
    "Unsharded Param": "gathered", "All Gather": "gathered",
    "Activation": "activations",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "OptState": "optimizer",
    "Temp": "temporaries", "Reduce Scatter": "temporaries", "Inputs": "temporaries",
}


@dataclass
class Observation:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    at_peak: dict[str, int]
    comm: dict = field(default_factory=dict)
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the largest total in each phase
    step_log: record.StepLog | None = None  # traced steps only; not in the JSON report, whose size it would multiply

    def as_dict(self) -> dict:
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes, "peak_bytes": self.peak_bytes,
                "at_peak": self.at_peak, "comm": self.comm, "phase_peaks": self.phase_peaks}


def create_optimizer_state(model, optimizer) -> None:
    """Run one update with zero gradients so that the optimizer's state exists, as it does
    in every step after the first: the observed step is a steady-state one."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _fold(snapshot: dict) -> tuple[int, dict[str, int]]:
    parts = dict.fromkeys(sorted(set(MEMORY_PARTS.values())), 0)
    total = 0
    for device, per_device in snapshot.items():
        if device.type == "meta":  # no memory (torch_internals.memory_tracker)
            continue
        for key, nbytes in per_device.items():
            name = getattr(key, "value", key)
            if name in MEMORY_PARTS:
                parts[MEMORY_PARTS[name]] += nbytes
            elif name == "Total":
                total += nbytes
    return total, parts


def observe_step(model, cfg, dims, device, fake: bool, trace: bool = False) -> Observation:
    """Build the optimizer, bring it to its steady state, then run and observe one step
    of the engine's train_step on a batch of this rank's shape; `trace`: with its order
    (record.StepLog)."""
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.training.steps)
    create_optimizer_state(model, optimizer)
    t = cfg.training
    # Checked as a real step checks it: simulate's callers other than the launcher (the
    # search, the tests' workers) would otherwise observe a step of 0 rows.
    rows = rows_per_data_rank(t.global_batch, dims.data_size)
    length = t.seq_len // dims.cp_size  # cp: this rank's two chunks
    inputs = torch.zeros(rows, length, dtype=torch.long, device=device)
    targets = torch.zeros(rows, length, dtype=torch.long, device=device)
    table = record.CommTable()
    log = record.StepLog() if trace else None
    grads = {}
    roots = parts_of(model)  # each pipeline stage's part is an FSDP root of its own
    tracker = torch_internals.memory_tracker(roots, optimizer)
    tracker.track_inputs((inputs, targets))
    # The tracker refuses a second forward of a root (a second micro-batch) while it holds
    # statistics of the root's first; the step's peak, which the report reads, is kept apart
    # from them. Only the root's are dropped: a pipeline's micro-batches overlap, and the
    # blocks' backward of an earlier one still reads theirs. A global hook, because it must
    # run before FSDP's own pre-forward hook on the root.
    def forget_root(module, _):
        if any(module is root for root in roots):
            tracker.memory_tracking.pop(module, None)

    clear_module_stats = register_module_forward_pre_hook(forget_root)
    pipelined = hasattr(model, "pipeline")
    warmup = torch_internals.pipeline_warmup_without_messages() if pipelined else nullcontext()
    released = torch_internals.fake_stage_outputs_released() if pipelined and fake else nullcontext()
    held = torch_internals.fake_messages_held_as_real_ones() if pipelined and fake else nullcontext()
    with record.isolated_collectives(fake, device), tracker, record.recording(dims, table, fake, log) as phase, \
            warmup, released, held, (shapes_only() if fake else nullcontext()):
        tracker.phase_of = lambda: phase.phase
        train_step(model, optimizer, scheduler, inputs, targets, cfg.optim.max_norm, dims.data.get_group(),
                   t.micro_batches, inspect_grads=lambda m: grads.update(bytes=record.grad_bytes(m)),
                   after_backward=phase.optimizer)
    clear_module_stats.remove()
    peak, at_peak = _fold(tracker.get_tracker_snapshot("peak"))
    return Observation(param_bytes=record.param_bytes(model), grad_bytes=grads["bytes"],
                       optimizer_bytes=record.optimizer_bytes(optimizer), peak_bytes=peak, at_peak=at_peak,
                       comm=table.as_dict(), phase_peaks=dict(tracker.phase_peaks), step_log=log)
