"""Context parallelism: every sequence is split over the `cp` ranks, and attention
attends across them.

The split. A sequence of S tokens is cut into 2 x cp chunks of S / (2 cp); cp rank i
holds chunks i and 2 cp - 1 - i, side by side. Under a causal mask a chunk's work grows
with its position, so pairing an early chunk with its mirror gives every rank the same
amount of attention. `split_sequence` cuts a batch this way and `local_positions` says
which global position each local token has.

Attention. Queries stay local; keys and values are all-gathered over cp (Llama 3's
choice: with grouped-query attention they are a fraction of the queries' size) by
`gather_sequence`, an autograd function on the public collectives whose backward
reduce-scatters their gradients. Each local chunk then attends to the keys up to its own
end, causally by global position. On CUDA that is one call per chunk with torch's
lower-right causal bias, which its flash and memory-efficient kernels take without
building a mask. The CPU kernels have no lower-right causal mode, so there a chunk's
queries go in blocks of MASK_ROWS, each with an additive mask (0 or -inf) that is a view
of one (MASK_ROWS x S) mask per forward: its memory does not grow with the square of S.
Additive, in the compute dtype: SDPA turns a boolean mask into a new one of those per
call, which the backward keeps (128 MiB more per rank at 8,192 tokens and cp=4, measured).

A plan names its attention cores (`Plan.attention`): modules called as core(q, k, v)
that compute causal softmax attention. With cp > 1 the engine replaces their forward
with the attention above, and passes the model its tokens' global positions
(`forward(tokens, positions=...)`); docs/plans.md has the contract.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from common.errors import UserError
from parallel.mesh import MeshSpec, ParallelDims
from parallel.plan import Plan, expand

# torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor (they warn) for
# these names, which 2.11 does not have.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Query rows per attention call on devices without a lower-right causal kernel: the
# shared mask holds MASK_ROWS x S values (128 MiB in bf16 at S = 131,072).
MASK_ROWS = 512


def chunk_pair(rank: int, size: int) -> tuple[int, int]:
    """The two of the 2 x size chunks of a sequence that cp rank `rank` holds."""
    return rank, 2 * size - 1 - rank


def split_sequence(tensor: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of `tensor` along `dim`: its two chunks, side by side."""
    if size == 1:
        return tensor
    chunks = tensor.chunk(2 * size, dim)
    first, second = chunk_pair(rank, size)
    return torch.cat((chunks[first], chunks[second]), dim)


def local_positions(local_length: int, rank: int, size: int, device=None) -> torch.Tensor:
    """The global position of each of this cp rank's `local_length` tokens."""
    chunk = local_length // 2
    first, second = chunk_pair(rank, size)
    return torch.cat([torch.arange(index * chunk, (index + 1) * chunk, device=device) for index in (first, second)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dimension 0 over `group`; the backward reduce-scatters (sums) the
    gradient, since every rank's attention used every rank's keys and values."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        local = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _reduce_scatter(local, grad.contiguous(), group=ctx.group)
        return local, None


# Left out of torch.compile, a graph break in each attention: traced into a compiled block,
# torch 2.11 computed the keys' and values' gradients wrong (wv's step-0 gradient off by
# 1.2e-2 at cp=2, parity FAIL); 2.13 was right either way.
@torch.compiler.disable
def _gather(local: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(local, group)


def gather_sequence(local: torch.Tensor, group, size: int) -> torch.Tensor:
    """The whole sequence of `local` (batch, heads, 2c, head_dim) from every cp rank's
    chunk pair, in position order: (batch, heads, 2 c size, head_dim)."""
    chunk = local.shape[2] // 2
    gathered = _gather(local.movedim(2, 0), group)  # rank by rank: chunks r, 2 size - 1 - r
    pieces = gathered.unflatten(0, (2 * size, chunk))
    order = [2 * index if index < size else 2 * (2 * size - 1 - index) + 1 for index in range(2 * size)]
    in_order = pieces.index_select(0, torch.tensor(order, device=local.device))
    return in_order.flatten(0, 1).movedim(0, 2)


_SHAPES_ONLY = [False]  # set by shapes_only()


@contextmanager
def shapes_only():
    """For the dry run, whose fake tensors carry shapes and no values: attention takes the
    GPU's form, one call per chunk and no mask, so that its memory and time are a GPU's.
    A top-left causal call of the same shapes stands in for the lower-right one, which the
    CPU kernels (the dry run's) cannot run without building the mask."""
    _SHAPES_ONLY[0] = True
    try:
        yield
    finally:
        _SHAPES_ONLY[0] = False


@dataclass
class ContextState:
    """What the attention cores of one model share: the cp group and this rank's place
    in it, and, on devices without a lower-right causal kernel, the current forward's mask."""

    group: object
    rank: int
    size: int
    dtype: torch.dtype  # the compute dtype, which an additive mask must have
    mask: torch.Tensor | None = None

    def prepare(self, local_length: int, device: torch.device) -> None:
        """Before each forward of the model: the mask for sequences of this length. Row i
        lets the query at position S - MASK_ROWS + i see keys 0 .. that position."""
        if device.type == "cuda" or _SHAPES_ONLY[0]:
            return
        length = local_length * self.size
        self.mask = torch.full((MASK_ROWS, length), float("-inf"), dtype=self.dtype,
                               device=device).triu(length - MASK_ROWS + 1)


def attend_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, state: ContextState) -> torch.Tensor:
    """Causal attention of `q`, the queries at positions end - len(q) .. end - 1, to the
    keys and values at positions 0 .. end - 1 (the first `end` of `k` and `v`)."""
    gqa = q.shape[1] != k.shape[1]
    rows = q.shape[2]
    if state.mask is None:  # CUDA: flash and memory-efficient kernels take this bias as is
        causal = {"is_causal": True} if _SHAPES_ONLY[0] else {"attn_mask": causal_lower_right(rows, end)}
        return F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], enable_gqa=gqa, **causal)
    length = state.mask.shape[1]
    outs = []
    for first in range(0, rows, MASK_ROWS):
        block = min(MASK_ROWS, rows - first)
        last = end - rows + first + block  # one past the position of the block's last query
        # The shared mask's lower-right corner of (block x last) does for this block what the
        # whole does for the last MASK_ROWS positions.
        mask = state.mask[MASK_ROWS - block:, length - last:]
        outs.append(F.scaled_dot_product_attention(q[:, :, first:first + block], k[:, :, :last], v[:, :, :last],
                                                   attn_mask=mask, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def attend_across_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: ContextState) -> torch.Tensor:
    """Causal attention of this rank's queries to the whole sequence's keys and values.
    Tensors are (batch, heads, 2c, head_dim), the two local chunks of c positions each."""
    keys, values = (gather_sequence(t, state.group, state.size) for t in (k, v))
    chunk = q.shape[2] // 2
    first, second = chunk_pair(state.rank, state.size)
    return torch.cat([attend_prefix(q[:, :, :chunk], keys, values, (first + 1) * chunk, state),
                      attend_prefix(q[:, :, chunk:], keys, values, (second + 1) * chunk, state)], dim=2)


def _pass_positions(state: ContextState, module, args, kwargs):
    # A later pipeline stage receives the hidden state, with sequence parallel its tp-th
    # of the rank's tokens (parallel/pipeline.py: sequence_split).
    first = args[0]
    length = first.shape[1] * getattr(module, "sequence_split", 1)
    kwargs.setdefault("positions", local_positions(length, state.rank, state.size, first.device))
    state.prepare(length, first.device)
    return args, kwargs


def apply_context_parallel(model: nn.Module, plan: Plan, dims: ParallelDims, dtype: torch.dtype) -> list[str]:
    """Make the plan's attention cores attend across the cp ranks, and give the model its
    tokens' global positions. `dtype` is the compute dtype. Returns the cores' paths."""
    state = ContextState(dims.cp.get_group(), dims.cp_rank, dims.spec.cp, dtype)
    cores = expand(model, plan.attention, plan.name)
    for path in cores:
        model.get_submodule(path).forward = functools.partial(attend_across_context, state=state)
    model.register_forward_pre_hook(functools.partial(_pass_positions, state), with_kwargs=True)
    return cores


def check_context_parallel(model: nn.Module, plan: Plan, spec: MeshSpec, seq_len: int, sequence_parallel: bool) -> None:
    """What cp > 1 needs of the plan, the model (on meta) and the sequence length, checked
    before any process group exists."""
    if spec.cp == 1:
        return
    if plan.attention is None:
        raise UserError(f"--mesh {spec} splits every sequence over cp={spec.cp} ranks, but plan {plan.name!r} names "
                        f"no attention core, so no rank's attention could see the others' tokens. Give the plan "
                        f"attention=\"<path glob of the modules called as core(q, k, v)>\" (docs/plans.md), or "
                        f"use a mesh without cp.")
    expand(model, plan.attention, plan.name)
    if "positions" not in inspect.signature(model.forward).parameters:
        raise UserError(f"--mesh {spec} gives each rank two chunks of every sequence, so the model must be told its "
                        f"tokens' positions, as forward(tokens, positions=None), and {type(model).__name__}.forward "
                        f"takes no `positions`. Add it (docs/plans.md, the model contract), or use a mesh without cp.")
    if seq_len % (2 * spec.cp):
        raise UserError(f"training.seq_len={seq_len} does not split into 2 x cp = {2 * spec.cp} equal chunks "
                        f"(--mesh {spec}): each cp rank holds two, one from each end of the sequence, so that "
                        f"causal attention costs every rank the same. Use a multiple of {2 * spec.cp}.")
    if sequence_parallel and (seq_len // spec.cp) % spec.tp:
        raise UserError(f"training.seq_len={seq_len} leaves each of cp={spec.cp} ranks {seq_len // spec.cp} tokens, "
                        f"which do not split over tp={spec.tp} with parallel.sequence_parallel=true. Use a multiple "
                        f"of {2 * spec.cp * spec.tp}.")
