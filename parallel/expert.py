"""Expert parallelism (`ep` in --mesh): each mixture of experts' routed experts are split
over the ep ranks, and every token travels to the rank that holds its expert and back.

The ep ranks are borrowed from dp, as torchtitan borrows them from its data ranks: they
read different rows, attention and every dense weight stay as dp has them, and only the
experts are split. So adding ep changes neither the world size nor the batch, and each
expert sees the tokens of its ep group's ep ranks. The world mesh's dp dimension is
split, in a mesh of its own for the experts (ParallelDims.experts), into
(expert-dp, ep), ep inside: the experts' weights are sharded over ep by expert
(DTensor Shard(0)) and FSDP shards each rank's experts over the expert-dp ranks (and cp).
Where those are one rank (ep = dp, no cp or hsdp), FSDP would have nothing to shard or
average, so the experts stay out of it (parallel/apply.py: shard_experts) and cast
their weights to the compute dtype themselves.

Dispatch and combine are all_to_all_single with uneven splits (gloo and NCCL both
implement it; gloo lacks the list form, pytorch#88245). Each expert's gradient sums
the tokens of ep data ranks, so it is scaled by 1/ep on the way back; FSDP's average over
the remaining data ranks then completes the mean over all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from common.errors import UserError
from parallel.plan import Plan, expand


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, received: list[int], sent: list[int], group):
        ctx.splits, ctx.group = (received, sent), group
        out = x.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        received, sent = ctx.splits
        back = grad.new_empty((sum(sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), sent, received, group=ctx.group)
        return back, None, None, None


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


@torch.compiler.disable
def exchange(x: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
    """_AllToAll, kept out of torch.compile's graphs: torch 2.11 compiled it (at dp=4,ep=4,
    bf16, selective AC) into a step whose expert w2 gradient was 1.9e-3 off one device's,
    against a parity limit of 1.5e-3, and whose loss drifted by up to 8.7e-2 over 5 steps;
    run eagerly, the same step is within 5.3e-5 and 4.6e-4 (docs/parallelism.md). The
    split sizes come from a .tolist(), where the graph breaks anyway."""
    return _AllToAll.apply(x, received, sent, group)


def dispatch_forward(experts: nn.Module, group, x: torch.Tensor, counts: torch.Tensor,
                     sizes: list[int] | None = None, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The experts module's forward under ep: x holds this rank's tokens sorted by (global)
    expert, counts[e] of them for expert e. They go to the ranks holding their experts,
    run there sorted by local expert, and come back in x's order. `sizes`: the counts as a
    list, where a dry run assumes them (models/moe.py: assumed_sizes); every ep rank is then
    taken to send this rank's experts what this rank sends them. `compute_dtype`: what
    the weights are cast to, where FSDP does not do it."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    received_counts = torch.empty_like(counts)  # [source rank, local expert]
    dist.all_to_all_single(received_counts, counts, group=group)
    if sizes is None:
        sent = counts.view(ep, local).sum(1).tolist()
        received_per_rank = received_counts.view(ep, local)
        received_rows = received_per_rank.sum(1).tolist()
        local_sizes = None
    else:
        sent = [sum(sizes[rank * local:(rank + 1) * local]) for rank in range(ep)]
        mine = sizes[dist.get_rank(group) * local:(dist.get_rank(group) + 1) * local]
        received_per_rank = torch.tensor([mine] * ep, dtype=counts.dtype, device=counts.device)
        received_rows = [sum(mine)] * ep
        local_sizes = [size * ep for size in mine]
    received = exchange(x, received_rows, sent, group)
    # Received rows come by source rank, then local expert: sort them by local expert.
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep),
                                            received_per_rank.flatten(), output_size=sum(received_rows))
    order = expert_of_row.argsort(stable=True)
    weights = [_ScaleGradient.apply(w.to_local() if isinstance(w, DTensor) else w, 1.0 / ep)
               for w in (experts.w13, experts.w2)]
    if compute_dtype is not None:
        weights = [w.to(compute_dtype) for w in weights]
    local_counts = received_per_rank.sum(0)
    out = (experts.compute(received[order], local_counts, *weights) if local_sizes is None
           else experts.compute(received[order], local_counts, *weights, local_sizes))
    restored = torch.empty_like(out).index_copy_(0, order, out)
    return exchange(restored, sent, received_rows, group)


def expert_paths(model: nn.Module, plan: Plan) -> list[str]:
    return expand(model, plan.experts, plan.name) if plan.experts else []


def expert_placement(experts: nn.Module, shard_ranks: int):
    """FSDP's placement for each weight of an experts module (experts first: each rank's ep
    share, or all of them without ep): by expert where this rank's experts divide over
    FSDP's shard ranks, else along the first other dimension that divides, else by expert,
    padded. FSDP pads only its first dimension: sharding 1 expert by expert over 8 ranks
    pads it to 8, the first rank holds the whole expert and the others zeros, and every
    all-gather moves 8 experts' bytes (Mixtral 8x7B at dp=64,ep=8: rank 0 held 21.1 GiB
    of parameters and rank 63 0.19 GiB of optimizer state, docs/planning.md); along any
    other dimension it refuses what does not divide ("FSDP does not support uneven
    sharding on dim 1": DeepSeek-V3's w2, 7,168 rows, over 2,048 ranks; debug-moe's 8
    experts and 256 rows over 3)."""
    def placement(param) -> Shard:
        shape = (param.to_local() if isinstance(param, DTensor) else param).shape
        return Shard(next((dim for dim, size in enumerate(shape) if size % shard_ranks == 0), 0))
    return placement


def check_expert_parallel(model: nn.Module, plan: Plan, ep: int, dp: int, reshard, shard_ranks: int) -> None:
    """Refuse ep where it cannot split, before any process group (exit 2). `reshard`: the
    blocks' resolved reshard_after_forward; `shard_ranks`: FSDP's (dp x cp)."""
    if ep == 1:
        check_unsplit_experts(model, plan, reshard, shard_ranks)
        return
    if dp % ep:
        raise UserError(f"ep={ep} borrows its ranks from dp, so it must divide dp={dp}. Choose ep from the "
                        f"divisors of dp, or a larger dp (the world size stays the product without ep).")
    if not isinstance(reshard, bool):
        raise UserError(f"reshard_after_forward={reshard} (an integer reshard) does not run with ep={ep} yet: the "
                        f"experts are sharded over a mesh of their own. Set parallel.reshard_after_forward to true "
                        f"or false, or leave ep out of --mesh.")
    paths = expert_paths(model, plan)
    if not paths:
        raise UserError(f"ep={ep} splits a mixture of experts' experts, but plan {plan.name!r} names none "
                        f"(Plan.experts). Use a model with experts (model.name=llama_moe, "
                        f"parallel.plan=llama_moe), or leave ep out of --mesh.")
    for path in paths:
        n_experts = model.get_submodule(path).w13.shape[0]
        if n_experts % ep:
            raise UserError(f"ep={ep} must divide the number of experts, {n_experts} in {path}. Choose ep "
                            f"from the divisors of {n_experts}.")


def check_unsplit_experts(model: nn.Module, plan: Plan, reshard, shard_ranks: int) -> None:
    """Without ep, experts whose weights FSDP shards along a dimension other than the
    first (expert_placement: the experts do not divide over its ranks, and the rows do)
    reshard after forward to true or false only: torch's FSDP fails an integer reshard of
    them in backward (torch 2.13: an IndexError in its all-gather copy-out). Sharded by
    expert, padded or not, they take one (debug-moe at dp=6 with reshard 2: --parity PASS,
    2026-12-07)."""
    if isinstance(reshard, bool):
        return
    for path in expert_paths(model, plan):
        experts = model.get_submodule(path)
        placement = expert_placement(experts, shard_ranks)
        if any(placement(param).dim != 0 for param in experts.parameters(recurse=False)):
            raise UserError(f"reshard_after_forward={reshard} (an integer reshard) does not run with experts that "
                            f"FSDP shards along their rows: the {experts.w13.shape[0]} experts of {path} do not "
                            f"divide over its {shard_ranks} ranks (dp x cp), and their rows do. Set "
                            f"parallel.reshard_after_forward to true or false, or add ep to --mesh (a divisor of "
                            f"{experts.w13.shape[0]} and of dp).")


def apply_expert_parallel(model: nn.Module, plan: Plan, ep_mesh, compute_dtype: torch.dtype | None = None) -> list[str]:
    """Shard each experts module's weights over ep by expert and route its forward through
    dispatch_forward (`compute_dtype`: for experts FSDP leaves alone). Returns the modules'
    paths."""
    paths = expert_paths(model, plan)
    group = ep_mesh.get_group()
    for path in paths:
        experts = model.get_submodule(path)
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        experts.forward = lambda x, counts, sizes=None, experts=experts: dispatch_forward(
            experts, group, x, counts, sizes, compute_dtype)
    return paths
