"""The one place the engine reaches into torch.distributed.pipelining's private internals:
receive buffers that exist only while a micro-batch needs them.

Before torch 2.15 a PipelineStage allocates, on its first step, one buffer for each
micro-batch's received activations and one for each micro-batch's received gradients,
and keeps all of them for as long as the stage lives. Only the micro-batches in flight
need theirs: at Llama 3 405B's 8,192-GPU layout (32 micro-batches, 8 stages per rank,
32 MiB each) that is 16 GiB held on every rank for buffers mostly idle. torch 2.15
allocates a buffer when its receive is posted and lets it go when the micro-batch's
computation takes it; `stage_class()` then returns torch's own stage.

For 2.11 to 2.14, `LazyReceiveStage` does the same from outside:
- the stage's receive descriptors are built with `self.device` set to meta, so the
  up-front buffers are shapes only (no memory);
- `get_fwd_recv_ops` / `get_bwd_recv_ops` put a real buffer in place of a micro-batch's
  meta one just before the receive is posted;
- after the micro-batch's backward (`backward_one_chunk`) its buffers go back to meta.
  Autograd keeps what it still needs (the input, saved by the first norm; under a
  split backward, the weight pass's references) without the stage's reference.
Same-rank stages (the V schedule) hand tensors over through `set_local_*_input`; those
go back to meta after the backward too, instead of living until the next step.

What it touches on those versions: PipelineStage's `_prepare_forward_infra`,
`_create_grad_recv_info`, `get_fwd_recv_ops`, `get_bwd_recv_ops`, `backward_one_chunk`,
its `device`, `args_recv_info` and `grad_recv_info`, and the `buffer` of each receive
descriptor (a tensor; None or absent where nothing is received). Sent outputs stay held
until their backward before 2.15 (torch then starts the backward from a GradientEdge);
that is torch's, not changed here. `check_supported` runs before any process group
starts; tests/test_pipeline.py runs it and a real pipelined step on every torch the
compat run covers.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.pipelining import PipelineStage

from common.errors import UserError

_STAGE_MODULE = "torch.distributed.pipelining.stage"
OVERRIDDEN = ("_prepare_forward_infra", "_create_grad_recv_info", "get_fwd_recv_ops", "get_bwd_recv_ops",
              "backward_one_chunk")


def allocates_on_receive() -> bool:
    """Whether torch's own stage allocates receive buffers when the receive is posted (2.15)."""
    import importlib
    stage_module = importlib.import_module(_STAGE_MODULE)
    return hasattr(getattr(stage_module, "_RecvInfo", None), "allocate_buffer")


def missing_internals() -> list[str]:
    if allocates_on_receive():
        return []
    import importlib
    stage_module = importlib.import_module(_STAGE_MODULE)
    missing = [f"PipelineStage.{name}" for name in OVERRIDDEN if not hasattr(PipelineStage, name)]
    if not hasattr(stage_module, "_RecvInfo"):
        missing.append(f"{_STAGE_MODULE}._RecvInfo")
    return missing


def check_supported() -> None:
    missing = missing_internals()
    if missing:
        raise UserError(f"pipeline parallel (pp > 1) needs pipeline-stage internals that torch "
                        f"{torch.__version__} does not have ({', '.join(missing)}). The engine is tested on "
                        f"torch 2.11 to 2.15; use one of those.")


def stage_class() -> type:
    return PipelineStage if allocates_on_receive() else LazyReceiveStage


def _is_placeholder(buffer) -> bool:
    return isinstance(buffer, torch.Tensor) and buffer.is_meta


def _empty_like(buffer: torch.Tensor, device) -> torch.Tensor:
    """A buffer of `buffer`'s shape, strides, dtype and requires_grad on `device`."""
    return torch.empty_strided(buffer.shape, buffer.stride(), dtype=buffer.dtype,
                               device=device).requires_grad_(buffer.requires_grad)


class LazyReceiveStage(PipelineStage):
    """A PipelineStage whose receive buffers are real only from their receive to the end of
    their micro-batch's backward (torch 2.11 to 2.14; the module's docstring says how)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._placeholders: dict[tuple[str, int], tuple] = {}

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

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._release(("forward", bwd_chunk_id), self.args_recv_info.get(bwd_chunk_id, ()))
        self._release(("backward", bwd_chunk_id), self.grad_recv_info.get(bwd_chunk_id, ()))
        return result
