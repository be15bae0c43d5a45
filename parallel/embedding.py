"""A vocabulary-split embedding whose gradient is only this rank's rows.

RowwiseParallel splits an nn.Embedding's table by rows (the vocabulary) over the TP ranks,
but DTensor has no backward rule for that split (torch 2.11 to 2.15: embedding_dense_backward
offers only the embedding-dim split, a batch split and partial sums), so every rank
computes the gradient of the whole table, replicated, and then keeps its rows. At 405B,
tp=8, that is a 4 GiB bf16 table per rank in each backward, and under a pipeline, whose
micro-batches accumulate unsharded gradients in the reduce dtype, an 8 GiB fp32 one kept
all step on the first stage.

Here each rank looks up the tokens that fall in its rows, in its own slice of the table,
zeroes the rest, and hands back a partial sum, as Megatron's vocabulary-parallel embedding
does. Autograd then differentiates only the local lookup, so the gradient is the rank's
rows. The parameters, their layout and the module's inputs and outputs are RowwiseParallel's:
checkpoints, FSDP and every output layout are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import RowwiseParallel


class VocabShardedEmbedding(nn.Embedding):
    """An nn.Embedding whose weight is a DTensor split by rows over a 1-D TP mesh."""

    def forward(self, tokens):
        table = self.weight
        mesh = table.device_mesh
        rows = table.to_local()
        first = mesh.get_local_rank() * rows.shape[0]
        end = first + rows.shape[0]
        ids = tokens.to_local() if isinstance(tokens, DTensor) else tokens
        elsewhere = (ids < first) | (ids >= end)
        local_ids = (ids - first).masked_fill(elsewhere, 0)
        mine = self.padding_idx is not None and first <= self.padding_idx < end
        padding = self.padding_idx - first if mine else None
        # The lookup's backward needs only the ids and the table, so its output can be
        # zeroed in place.
        looked_up = F.embedding(local_ids, rows, padding).masked_fill_(elsewhere.unsqueeze(-1), 0)
        return DTensor.from_local(looked_up, mesh, [Partial()], run_check=False)


class VocabParallel(RowwiseParallel):
    """RowwiseParallel for an nn.Embedding, computed as VocabShardedEmbedding."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.__class__ = VocabShardedEmbedding
        return module


def computes_locally(module: nn.Module) -> bool:
    """Whether VocabShardedEmbedding computes what this module's own forward does: a plain
    nn.Embedding (a subclass may change its forward) without the options that read or
    write the whole table (max_norm renormalises rows in place; scale_grad_by_freq counts
    every token, the other ranks' included; sparse gradients)."""
    return (type(module) is nn.Embedding and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse)


def vocab_parallel_styles(model: nn.Module, styles: dict) -> dict:
    """`styles` (module path -> style) with RowwiseParallel on each plain nn.Embedding
    replaced by VocabParallel with the same layouts; the rest as given."""
    def replaced(path, style):
        if type(style) is not RowwiseParallel or not computes_locally(model.get_submodule(path)):
            return style
        local = VocabParallel.__new__(VocabParallel)
        local.__dict__.update(vars(style))
        return local
    return {path: replaced(path, style) for path, style in styles.items()}
