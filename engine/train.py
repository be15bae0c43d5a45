"""The step loop: optimizer, LR schedule, loss over the global batch, clipping, logging.

The same `train_step` runs a sharded model and a single-process reference, so
parity tests compare the engine with itself minus the parallelism.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.data import local_batch
from engine.grad_norm import clip_grad_norm
from engine.metrics import StepLog


def build_optimizer(model: torch.nn.Module, optim_cfg, total_steps: int):
    """AdamW over the (already sharded) parameters, with linear warmup then cosine decay."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr,
                                  betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
                                  weight_decay=optim_cfg.weight_decay)
    warmup, floor = optim_cfg.warmup_steps, optim_cfg.min_lr_ratio

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over this rank's tokens. Every data rank holds the same number of
    tokens and FSDP averages gradients over data ranks, so this is the global-batch mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def global_mean(value: torch.Tensor, group) -> float:
    """Average a scalar over the data-parallel ranks (gloo has no AVG, so SUM then divide)."""
    if group is None:
        return value.item()
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value.item() / dist.get_world_size(group)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float


def train_step(model, optimizer, scheduler, inputs, targets, max_norm: float,
               data_group=None) -> StepResult:
    lr = scheduler.get_last_lr()[0]
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    norm = clip_grad_norm(model.parameters(), max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=global_mean(loss, data_group), grad_norm=norm.item(), lr=lr)


def train(model, cfg, source, dims, device, log: StepLog, checkpoint=None) -> list[StepResult]:
    """`checkpoint` (an engine.checkpoint.Checkpointer) restores state and saves it."""
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.training.steps)
    start = checkpoint.resume(model, optimizer, scheduler) if checkpoint else 0
    t = cfg.training
    tokens_per_step = t.global_batch * t.seq_len
    results = []
    for step in range(start, t.steps):
        started = time.perf_counter()
        inputs, targets = local_batch(source, step, t.global_batch, t.seq_len,
                                      dims.data_rank, dims.data_size)
        result = train_step(model, optimizer, scheduler, inputs.to(device), targets.to(device),
                            cfg.optim.max_norm, dims.data.get_group())
        results.append(result)
        log.step(step, result, tokens_per_step, time.perf_counter() - started)
        if checkpoint:
            checkpoint.step_finished(step)
    if checkpoint:
        checkpoint.close()
    log.summary(results, tokens_per_step)
    return results
