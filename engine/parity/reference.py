"""The single-device side of a parity check: the same optimizer, clipping and schedule
as the mesh run, in one process, over the whole global batch."""

from __future__ import annotations

import dataclasses

import torch

from engine.grad_norm import clip_grad_norm
from engine import routing
from engine.train import ONE_DEVICE, build_optimizer, evaluate, forward_backward


class Reference:
    def __init__(self, model: torch.nn.Module, cfg, compute: torch.nn.Module | None = None, slices: int = 1):
        """`compute`, when given, is a low-precision copy of `model` that runs forward and
        backward from the fp32 master weights, as FSDP's mixed precision does. `slices`:
        the equal runs of rows each forward takes, the same mean loss and gradient; more
        than one where the mesh's numbers depend on them (float8 tensorwise scaling, whose
        scale comes from each forward's own rows: launch/parity.py, tensorwise_slices)."""
        self.model = model
        self.compute = compute if compute is not None else model
        self.optimizer, self.scheduler = build_optimizer(model, cfg.optim, cfg.training.steps)
        self.max_norm = cfg.optim.max_norm
        self.slices = slices

    def _refresh_compute(self) -> None:
        with torch.no_grad():
            for master, low in zip(self.model.parameters(), self.compute.parameters()):
                low.copy_(master)

    def evaluate(self, source, cfg, device) -> float:
        """The held-out loss over the whole global batches, as engine.train.evaluate."""
        if self.compute is not self.model:
            self._refresh_compute()
        sliced = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, micro_batches=self.slices))
        return evaluate(self.compute, source, sliced, ONE_DEVICE, device)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, slices: int | None = None) -> float:
        """`slices`: None takes the reference's own."""
        slices = slices or self.slices
        if self.compute is self.model:
            return forward_backward(self.model, inputs, targets, slices).item()
        self._refresh_compute()
        loss = forward_backward(self.compute, inputs, targets, slices)
        for master, low in zip(self.model.parameters(), self.compute.parameters()):
            master.grad = low.grad.float()  # FSDP reduces and keeps gradients in fp32 too
            low.grad = None
        return loss.item()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, inspect_grads=None) -> tuple[float, float, float]:
        """One optimizer step; returns (loss, gradient norm before clipping, learning rate)."""
        lr = self.scheduler.get_last_lr()[0]
        loss = self.forward_backward(inputs, targets)
        # The routers' bias moves as the mesh's does, by the global load (the compute copy
        # routes: its buffers, not the masters', are the ones forward reads).
        routing.finish_step(self.compute, None, None, self.compute, inputs)
        routing.balance(self.compute)
        if inspect_grads is not None:
            inspect_grads(self.model)
        norm = clip_grad_norm(self.model.parameters(), self.max_norm).item()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm, lr
