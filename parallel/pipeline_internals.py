"""The one place the engine reaches into torch.distributed.pipelining's private internals:
a message's tensor is held only while its micro-batch needs it.

Receive buffers. Before torch 2.15 a PipelineStage allocates, on its first step, one
buffer for each micro-batch's received activations and one for each micro-batch's
received gradients, and keeps all of them for as long as the stage lives. Only the
micro-batches in flight need theirs: at Llama 3 405B's 8,192-GPU layout (32
micro-batches, 8 stages per rank, 32 MiB each) that is 16 GiB on every rank. torch 2.15
allocates a buffer when its receive is posted and lets it go when the micro-batch's
computation takes it; `stage_class()` then returns torch's own stage. For 2.11 to 2.14,
`ReleasingStage` does the same from outside:
- the stage's receive descriptors are built with `self.device` set to meta, so the
  up-front buffers are shapes only (no memory);
- `get_fwd_recv_ops` / `get_bwd_recv_ops` put a real buffer in place of a micro-batch's
  meta one just before the receive is posted;
- after the micro-batch's backward (`backward_one_chunk`) its buffers go back to meta.
  Autograd keeps what it still needs (the input, saved by the first norm; under a
  split backward, the weight pass's references) without the stage's reference.
  Same-rank stages (the V schedule) hand tensors over through `set_local_*_input`;
  those go back to meta after the backward too, instead of living until the next step.

Forward sends. The looped schedules' runtime before 2.15 keeps the Work of every send it
posts until the step ends, and a Work keeps the tensor it sent (seen on gloo: the tensor
lives as long as its Work, waited or not). `releasing_forward_sends(schedule)` has the
schedule keep a handle instead, which the sending stage waits for and empties at the
micro-batch's backward: the next stage has sent that micro-batch's gradient by then, so
it has received the activation and the wait returns at once. A gradient sent backward
is still held to the step's end (no later message says when the previous stage took
it; a gloo send's Work learns that it is done only by waiting, which could block), and
the dry run counts it so (engine/dryrun/torch_internals.py:
fake_messages_held_as_real_ones). 2.15's schedules wait for their sends as they go.

What it touches on 2.11 to 2.14: PipelineStage's `_prepare_forward_infra`,
`_create_grad_recv_info`, `get_fwd_recv_ops`, `get_bwd_recv_ops`, `get_fwd_send_ops`,
`backward_one_chunk`, its `device`, `args_recv_info` and `grad_recv_info`, the `buffer`
of each receive descriptor (a tensor; None or absent where nothing is received), and
the schedules module's `_batch_p2p`, through which every schedule posts its messages and
of whose result it only calls `wait()`. `check_supported` runs before any process group
starts; tests/test_pipeline_internals.py runs it, and the receive and send cases, on
every torch the compat run covers.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from common.errors import UserError

_STAGE_MODULE = "torch.distributed.pipelining.stage"
_SCHEDULES_MODULE = "torch.distributed.pipelining.schedules"
OVERRIDDEN = ("_prepare_forward_infra", "_create_grad_recv_info", "get_fwd_recv_ops", "get_bwd_recv_ops",
              "get_fwd_send_ops", "backward_one_chunk")


def allocates_on_receive() -> bool:
    """Whether torch's own stage allocates receive buffers when the receive is posted, and its
    schedules let go of each send as they go (2.15)."""
    stage_module = importlib.import_module(_STAGE_MODULE)
    return hasattr(getattr(stage_module, "_RecvInfo", None), "allocate_buffer")


def missing_internals() -> list[str]:
    if allocates_on_receive():
        return []
    stage_module = importlib.import_module(_STAGE_MODULE)
    missing = [f"PipelineStage.{name}" for name in OVERRIDDEN if not hasattr(PipelineStage, name)]
    if not hasattr(stage_module, "_RecvInfo"):
        missing.append(f"{_STAGE_MODULE}._RecvInfo")
    if not hasattr(importlib.import_module(_SCHEDULES_MODULE), "_batch_p2p"):
        missing.append(f"{_SCHEDULES_MODULE}._batch_p2p")
    return missing


def check_supported() -> None:
    missing = missing_internals()
    if missing:
        raise UserError(f"pipeline parallel (pp > 1) needs pipeline-stage internals that torch "
                        f"{torch.__version__} does not have ({', '.join(missing)}). The engine is tested on "
                        f"torch 2.11 to 2.15; use one of those.")


def stage_class() -> type:
    return PipelineStage if allocates_on_receive() else ReleasingStage


# While a step of a schedule from releasing_forward_sends runs: a forward send's P2POp, by
# id, -> the handles of its micro-batch's sends on its stage (ReleasingStage.get_fwd_send_ops
# fills it, the schedule's _batch_p2p empties it). None otherwise, so that no id outlives
# its op into a step.
_FORWARD_SENDS: dict[int, list] | None = None


class _SendHandle:
    """Stands for a send's Work in the schedule's list of sends to wait for at the step's end.
    A Work keeps the tensor it sent for as long as it lives (seen on gloo), so once the send
    is known to be done the handle waits for it and lets it go."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs) -> bool:
        if self.work is not None:
            self.work.wait(*args, **kwargs)
            self.work = None
        return True


def releasing_forward_sends(schedule):
    """`schedule`, whose every step lets go of each forward send at its micro-batch's
    backward on the sending stage, instead of at the step's end (before torch 2.15; 2.15's
    schedules wait for their sends as they go)."""
    if allocates_on_receive():
        return schedule
    step = schedule.step

    def step_releasing_sends(*args, **kwargs):
        with _forward_sends_released():
            return step(*args, **kwargs)

    schedule.step = step_releasing_sends
    return schedule


@contextmanager
def _forward_sends_released():
    global _FORWARD_SENDS
    schedules = importlib.import_module(_SCHEDULES_MODULE)
    post = schedules._batch_p2p

    def post_keeping_handles(p2p_ops, *args, **kwargs):
        works = post(p2p_ops, *args, **kwargs)
        owners = [_FORWARD_SENDS.pop(id(op), None) for op in p2p_ops]
        if any(owner is None for owner in owners) or not all(op.op is dist.isend for op in p2p_ops):
            return works
        handles = [_SendHandle(work) for work in works]
        for owner in {id(owner): owner for owner in owners}.values():
            owner.extend(handles)
        return handles

    schedules._batch_p2p, _FORWARD_SENDS = post_keeping_handles, {}
    try:
        yield
    finally:
        schedules._batch_p2p, _FORWARD_SENDS = post, None


def _is_placeholder(buffer) -> bool:
    return isinstance(buffer, torch.Tensor) and buffer.is_meta


def _empty_like(buffer: torch.Tensor, device) -> torch.Tensor:
    """A buffer of `buffer`'s shape, strides, dtype and requires_grad on `device`."""
    return torch.empty_strided(buffer.shape, buffer.stride(), dtype=buffer.dtype,
                               device=device).requires_grad_(buffer.requires_grad)


class ReleasingStage(PipelineStage):
    """A PipelineStage whose receive buffers are real only from their receive to the end of
    their micro-batch's backward, and whose forward sends, under releasing_forward_sends,
    are let go at that backward (torch 2.11 to 2.14; the module's docstring says how)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._placeholders: dict[tuple[str, int], tuple] = {}
        self._forward_sends: dict[int, list[_SendHandle]] = {}

    @contextmanager
    def _buffers_on_meta(self):
        device, self.device = self.device, torch.device("meta")
        try:
            yield
        finally:
            self.device = device

    def _prepare_forward_infra(self, *args, **kwargs):
        with self._buffers_on_meta():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _create_grad_recv_info(self, *args, **kwargs):
        with self._buffers_on_meta():
            return super()._create_grad_recv_info(*args, **kwargs)

    def _allocate(self, key: tuple[str, int], infos) -> None:
        buffers = tuple(getattr(info, "buffer", None) for info in infos)
        if not any(_is_placeholder(b) for b in buffers):
            return
        self._placeholders[key] = buffers
        for info, buffer in zip(infos, buffers):
            if _is_placeholder(buffer):
                info.buffer = _empty_like(buffer, self.device)

    def _release(self, key: tuple[str, int], infos) -> None:
        placeholders = self._placeholders.pop(key, (None,) * len(infos))
        for info, placeholder in zip(infos, placeholders):
            buffer = getattr(info, "buffer", None)
            if isinstance(buffer, torch.Tensor) and not buffer.is_meta:
                info.buffer = placeholder if placeholder is not None else _empty_like(buffer, "meta")

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(("forward", fwd_chunk_id), self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._allocate(("backward", bwd_chunk_id), self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if _FORWARD_SENDS is not None:
            handles = self._forward_sends.setdefault(fwd_chunk_id, [])
            for op in ops:
                _FORWARD_SENDS[id(op)] = handles
        return ops

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._release(("forward", bwd_chunk_id), self.args_recv_info.get(bwd_chunk_id, ()))
        self._release(("backward", bwd_chunk_id), self.grad_recv_info.get(bwd_chunk_id, ()))
        # The next stage sent this micro-batch's gradient, so it has received the forward
        # send: waiting for it returns at once.
        for handle in self._forward_sends.pop(bwd_chunk_id, ()):
            handle.wait()
        return result
