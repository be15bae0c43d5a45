"""The step loop: optimizer, LR schedule, loss over the global batch, clipping, logging.

The same `train_step` runs a sharded model and a single-process reference, so
parity tests compare the engine with itself minus the parallelism.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from engine.data.sources import TokenSource, local_batch
from engine.data.token_file import OutOfVocabulary
from engine import routing
from common.errors import NonFiniteLoss, UserError, raise_if_any_rank
from engine.grad_norm import clip_grad_norm
from engine.metrics.memory import LargestOverRanks
from engine.metrics.log import RunShape, StepLog
from engine.metrics.throughput import device_peak_flops, flops_per_token
from parallel.context import split_sequence
from parallel.pipeline import whole_model


def build_optimizer(model: torch.nn.Module, optim_cfg, total_steps: int):
    """AdamW (or plain SGD) over the (already sharded) parameters, with linear warmup then
    cosine decay."""
    if optim_cfg.name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay)
    else:
        # On CUDA one fused kernel updates every parameter (the default there takes several
        # passes over each optimizer tensor); elsewhere torch's default implementation.
        on_cuda = all(p.device.type == "cuda" for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr,
                                      betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps,
                                      weight_decay=optim_cfg.weight_decay, fused=True if on_cuda else None)
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


@functools.cache
def compiled_loss_fn():
    return torch.compile(loss_fn)


def loss_for(options) -> Callable:
    """The loss the loop takes. With parallel.compile it is compiled too: eager, the fp32
    copy of the logits and their log-softmax are two more vocabulary-wide tensors, each as
    large as the logits in fp32, written and read again in backward (an H100 spent 11 ms of
    a 180 ms step of the 1B flavor on them, docs/benchmarks.md). Vocabulary-sharded logits
    (loss_parallel) stay eager: their loss is DTensor code under loss_parallel()."""
    return compiled_loss_fn() if options.compile and not options.loss_parallel else loss_fn


def global_mean(value: torch.Tensor, group, stages=None, across_groups: Callable | None = None) -> float:
    """Average a scalar over the data-parallel ranks (gloo has no AVG, so SUM then divide).
    `stages`, the pipeline group, then brings the value from the last stage (the only one
    that computes a loss; the others hold 0) to every stage. `across_groups`, with
    fault-tolerant replica groups (parallel/replicas.py: Replicas.add_up), adds the groups'
    sums and returns how many there were, so that the mean is the one plain hsdp computes."""
    if group is None and stages is None and across_groups is None:
        return value.item()
    value = value.detach().clone()
    if group is not None:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    if stages is not None:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=stages)
    ranks = dist.get_world_size(group) if group is not None else 1
    if across_groups is not None:
        ranks *= across_groups(value)
    return value.item() / ranks


def pipeline_of(model):
    """The model's pipeline (parallel/pipeline.py), or None without pipeline parallel."""
    return getattr(model, "pipeline", None)


def pipeline_group(model):
    pipeline = pipeline_of(model)
    return pipeline.group if pipeline is not None else None


@functools.cache
def micro_batch_loss(loss: Callable, micro_batches: int) -> Callable:
    """One micro-batch's share of the mean loss, as the pipeline schedule calls it."""
    def share(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss(logits, targets) / micro_batches
    return share


def run_pipeline(model, inputs, targets, micro_batches: int, loss: Callable, backward: bool) -> torch.Tensor:
    """The pipeline schedule over this rank's rows: forward and backward (or, for an
    evaluation, the stages' forward alone). Returns the sum of the micro-batches' shares,
    i.e. this rank's mean loss, on the ranks of the last stage, and 0 on the others. Each
    micro-batch's share is divided before its backward, as in forward_backward, so the
    schedule scales nothing."""
    pipeline = pipeline_of(model)
    share_of = micro_batch_loss(loss, micro_batches)
    # The batch's inputs and targets are views of one token tensor one column wider; torch
    # 2.11's schedule runtime (interleaved zero bubble, ZBV) checks the first stage's input
    # strides against contiguous ones and refuses the view.
    inputs, targets = inputs.contiguous(), targets.contiguous()
    with loss_parallel() if pipeline.loss_parallel and pipeline.tp > 1 else nullcontext():
        if not backward:
            return pipeline.forward_only(inputs, targets, micro_batches, share_of)
        shares = []
        schedule = pipeline.schedule(micro_batches, share_of, inputs)
        # return_outputs=False: the last stage would keep every micro-batch's logits to the
        # end of the step (at 405B, 2 GiB each) to hand back a result nothing reads.
        schedule.step(*((inputs,) if pipeline.has_first else ()), target=targets, losses=shares, return_outputs=False)
    pipeline.sync_tied_gradients()
    total = torch.zeros((), device=inputs.device)
    for share in shares:
        total += (share.full_tensor() if isinstance(share, DTensor) else share).detach()
    return total


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    data_s: float = 0.0
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0
    skipped: bool = False  # the loss was NaN or inf, so the parameters were not updated
    val_loss: float | None = None  # set on evaluation steps (eval.every)
    eval_s: float = 0.0
    # A mixture of experts' routing in the step: each routed layer's figures over all data
    # ranks and stages (engine/routing.py: summary), None for a model without experts
    routed: dict | None = None
    # With fault-tolerant replica groups: whether every live group finished the step (if
    # not, nothing was updated and the batch is fed again), how many groups took part (0:
    # no such groups), and the groups' common count of committed steps after it
    committed: bool = True
    groups: int = 0
    replica_step: int = 0
    fingerprint: str = ""  # fault_tolerance.fingerprint: the group's weights after the step


def forward_backward(model, inputs, targets, micro_batches: int = 1, loss: Callable = loss_fn) -> torch.Tensor:
    """Accumulate the gradient of this rank's mean loss over `micro_batches` equal slices.
    Each slice's mean is divided by their count, so the sum is the mean over all rows and
    the gradient is that of one big batch. FSDP reduce-scatters only after the last slice.
    Vocabulary-sharded logits (loss parallel) need the loss and its backward inside
    loss_parallel(); the returned loss is a plain tensor either way. Under pipeline
    parallel the slices are the schedule's micro-batches (run_pipeline)."""
    routing.begin_step(model, micro_batches)
    if pipeline_of(model) is not None:
        return run_pipeline(model, inputs, targets, micro_batches, loss, backward=True)
    total = torch.zeros((), device=inputs.device)
    for index, (x, y) in enumerate(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches))):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(index == micro_batches - 1)
        logits = model(x)
        sharded = isinstance(logits, DTensor)
        with loss_parallel() if sharded else nullcontext():
            part = loss(logits, y) / micro_batches
            part.backward()
        total += (part.full_tensor() if sharded else part).detach()
    return total


def train_step(model, optimizer, scheduler, inputs, targets, max_norm: float,
               data_group=None, micro_batches: int = 1, inspect_grads=None,
               after_backward=None, loss: Callable = loss_fn, replicas=None) -> StepResult:
    """`inspect_grads(model)`, when given, sees the gradients before clipping (parity checks);
    `after_backward()` runs as soon as the backward has been issued (metrics). `replicas`
    (parallel/replicas.py), with fault-tolerant replica groups: the loss is averaged over
    the live groups too, and the optimizer and schedule step only if the step commits."""
    lr = scheduler.get_last_lr()[0]
    started = time.perf_counter()
    local_loss = forward_backward(model, inputs, targets, micro_batches, loss)
    if after_backward is not None:
        after_backward()
    # The mean is taken before the update so that every rank sees the same value and
    # takes the same branch below; reading it also waits for the backward on a GPU.
    loss = global_mean(local_loss, data_group, pipeline_group(model),
                       functools.partial(replicas.add_up, with_position=True) if replicas is not None else None)
    routed = routing.finish_step(model, data_group, pipeline_group(model), whole_model(model), inputs,
                                 replicas.add_up if replicas is not None else None)
    computed = time.perf_counter()
    if inspect_grads is not None:
        inspect_grads(model)
    skipped = not math.isfinite(loss)
    norm = clip_grad_norm(model.parameters(), max_norm, **norm_scope(model)).item()
    committed = replicas is None or replicas.commit()
    if committed and not skipped:
        optimizer.step()
    if committed:
        scheduler.step()
        routing.balance(model)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=loss, grad_norm=norm, lr=lr, forward_backward_s=computed - started,
                      optimizer_s=time.perf_counter() - computed, skipped=skipped, routed=routed,
                      committed=committed, groups=replicas.participants if replicas is not None else 0,
                      replica_step=replicas.step if replicas is not None else 0)


def rank_batch(source, step: int, training, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of global batch `step`: its data rank's rows and, with cp > 1, its
    two chunks of each row (parallel/context.py)."""
    inputs, targets = local_batch(source, step, training.global_batch, training.seq_len, dims.data_rank,
                                  dims.data_size)
    return split_sequence(inputs, dims.cp_rank, dims.cp_size), split_sequence(targets, dims.cp_rank, dims.cp_size)


def host_group():
    """All ranks, on gloo, for the loop's small host-side agreements: the default group
    when it is gloo, else a new one (a collective: every rank calls this)."""
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def agree_on_ids(read, source, group):
    """`read()` (a batch, or batches) on every rank of `group` (None: this process alone).
    Ids from a token folder are checked against the model's vocabulary as they are read
    (TokenSource); one rank stopping alone would leave the others waiting in the forward's
    collectives, so all ranks learn whether any rank found one, and all stop with its error."""
    if group is None or not isinstance(source, TokenSource):
        return read()  # corpus bytes and synthetic ids are in range by construction
    batch, problem = None, None
    try:
        batch = read()
    except OutOfVocabulary as err:
        problem = str(err)
    raise_if_any_rank(problem, group, OutOfVocabulary)
    return batch


def run_step(model, optimizer, scheduler, source, step: int, cfg, dims, device,
             unshard=None, after_backward=None, ids_group=None) -> StepResult:
    """One optimizer step of the loop: this rank's rows of batch `step`, then train_step.
    `unshard` starts the first all-gathers so that they overlap with building the batch."""
    started = time.perf_counter()
    if unshard is not None:
        unshard()
    t = cfg.training
    inputs, targets = agree_on_ids(lambda: rank_batch(source, step, t, dims), source, ids_group)
    inputs, targets = inputs.to(device), targets.to(device)
    data_s = time.perf_counter() - started
    result = train_step(model, optimizer, scheduler, inputs, targets, cfg.optim.max_norm,
                        dims.data.get_group(), t.micro_batches, after_backward=after_backward,
                        loss=loss_for(cfg.parallel), replicas=dims.replicas)
    result.data_s = data_s
    if result.committed and result.groups and cfg.fault_tolerance.fingerprint:
        result.fingerprint = dims.replicas.fingerprint(model)
    return result


def norm_scope(model) -> dict:
    """What the gradient norm adds under pipeline parallel: the other stages' gradients (an
    all-reduce over the pipeline group), each shared parameter counted once."""
    pipeline = pipeline_of(model)
    if pipeline is None:
        return {}
    copies = pipeline.copies()
    return {"stages": pipeline.group,
            "counted": [p for name, p in model.named_parameters() if name not in copies]}


# The data-parallel view of a single process: rank 0 of 1, no group, no replica groups (see
# parallel/mesh.py).
ONE_DEVICE = SimpleNamespace(data_rank=0, data_size=1, cp_rank=0, cp_size=1, replicas=None,
                             data=SimpleNamespace(get_group=lambda: None))


@torch.no_grad()
def evaluate(model, source, cfg, dims, device, ids_group=None) -> float:
    """The mean loss over eval.steps global batches of `source`. Every evaluation reads the
    same batches (batch k of the held-out data), so successive values are comparable. With
    fault-tolerant replica groups, over the rows of the groups of the step just taken."""
    t = cfg.training
    total = 0.0
    for batch in range(cfg.eval.steps):
        inputs, targets = agree_on_ids(lambda: rank_batch(source, batch, t, dims), source, ids_group)
        inputs, targets = inputs.to(device), targets.to(device)
        if pipeline_of(model) is not None:
            local = run_pipeline(model, inputs, targets, t.micro_batches, loss_for(cfg.parallel), backward=False)
        else:
            local = torch.zeros((), device=device)
            for x, y in zip(inputs.chunk(t.micro_batches), targets.chunk(t.micro_batches)):
                logits = model(x)
                sharded = isinstance(logits, DTensor)
                with loss_parallel() if sharded else nullcontext():
                    loss = loss_fn(logits, y) / t.micro_batches
                local += loss.full_tensor() if sharded else loss
        total += global_mean(local, dims.data.get_group(), pipeline_group(model),
                             dims.replicas.add_up if dims.replicas is not None else None)
    return total / cfg.eval.steps


def evaluates_after(step: int, cfg) -> bool:
    every = cfg.eval.every
    return every > 0 and ((step + 1) % every == 0 or step == cfg.training.steps - 1)


def logged_step(model, optimizer, scheduler, source, step: int, cfg, dims, device, log: StepLog,
                shape: RunShape, unshard=None, eval_source=None, ids_group=None) -> StepResult:
    """run_step, then its metrics. Memory is read after backward, where activations and
    gradients coexist, and reduced over ranks in the background (every rank calls this).
    An evaluation after the step is timed apart, so it does not lower the step's tok/s."""
    started = time.perf_counter()
    memory = LargestOverRanks(device)
    result = run_step(model, optimizer, scheduler, source, step, cfg, dims, device, unshard, memory.start, ids_group)
    seconds = time.perf_counter() - started
    if eval_source is not None and evaluates_after(step, cfg):
        result.val_loss = evaluate(model, eval_source, cfg, dims, device, ids_group)
        result.eval_s = time.perf_counter() - started - seconds
    log.step(step, result, seconds, shape, memory.result())
    return result


def run_shape(model, cfg, device) -> RunShape:
    t = cfg.training
    name, peak = device_peak_flops(device)
    # Every rank counts, the pipeline's included; the FLOPs are the whole model's.
    return RunShape(tokens_per_step=t.global_batch * t.seq_len, world_size=dist.get_world_size(),
                    flops_per_token=flops_per_token(whole_model(model), t.seq_len), device_name=name,
                    peak_flops=peak)


def fault_tolerance_no_live_group(position: int) -> str:
    return (f"this replica group was started again (fault_tolerance.rejoin=true) after it had committed "
            f"{position} global batches, but no live replica group was there to heal it from, so its "
            f"weights would be the initial ones. Start the whole job again, every group with "
            f"fault_tolerance.rejoin=false: it resumes from the last checkpoint, if there is one.")


def first_quorum(replicas, log: StepLog) -> int:
    """With fault-tolerant replica groups: the quorum of the first step, where a group started
    again heals from a live one. Returns this group's data position: a checkpoint's, a live
    group's record of it, or 0."""
    replicas.start_step()
    if not replicas.healed and replicas.last_position() > 0:
        raise UserError(fault_tolerance_no_live_group(replicas.last_position()))
    how = (f"healed from a live group at step {replicas.step}" if replicas.healed else
           f"at step {replicas.step}")
    log.print(f"replica group {replicas.group} of {replicas.groups}: {how}, from global batch {replicas.position}")
    return replicas.position


def train(model, cfg, source, dims, device, log: StepLog, unshard=None,
          checkpoint=None, eval_source=None) -> list[StepResult]:
    """`checkpoint` (an engine.checkpoint.Checkpointer) restores state and saves it;
    `eval_source`, when given, is evaluated every eval.every steps and after the last.
    With fault-tolerant replica groups a step that does not commit is taken again with the
    same batch, and `step` is this group's data position (parallel/replicas.py)."""
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.training.steps)
    replicas = dims.replicas
    if replicas is not None:
        replicas.keep(model, optimizer, scheduler)
    step = checkpoint.resume(model, optimizer, scheduler) if checkpoint else 0
    if replicas is not None:
        step = first_quorum(replicas, log)
    shape = run_shape(model, cfg, device)
    log.describe(shape)
    ids_group = host_group() if isinstance(source, TokenSource) else None
    results = []
    while step < cfg.training.steps:
        result = logged_step(model, optimizer, scheduler, source, step, cfg, dims, device, log, shape, unshard,
                             eval_source, ids_group)
        results.append(result)
        if result.committed:
            if replicas is not None and dist.get_rank() == 0:
                replicas.save_position()
            if result.skipped and not cfg.metrics.skip_nonfinite:
                log.close()
                last_good = checkpoint.last_complete() if checkpoint else None
                raise NonFiniteLoss(
                    f"the loss is {result.loss} at step {step + 1} (counting from 1); the run stops "
                    f"before updating the parameters with it. Last good checkpoint: "
                    f"{last_good or 'none'}. Lower optim.lr or optim.max_norm, or set "
                    f"metrics.skip_nonfinite=true to skip such steps.")
            if checkpoint:
                checkpoint.step_finished(step)
            step += 1
        if replicas is not None and step < cfg.training.steps:
            replicas.start_step()  # a group behind the live ones heals here
            step = replicas.position
    if checkpoint:
        checkpoint.close()
    log.summary(results, shape.tokens_per_step)
    return results
