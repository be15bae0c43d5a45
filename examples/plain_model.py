"""A model with nothing engine-specific: only torch layers, no `args`, no init_value, no
reset_buffers. The engine initialises it through its layers' own reset_parameters()
and reads its vocabulary from the embedding (docs/plans.md, "The model contract").

Load it with:  --set model.plugin=examples.plain_model --set model.name=plain --set parallel.plan=plain
"""

import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from models import register_model
from parallel.plan import Plan, Stages, register_plan

HEAD_DIM = 16


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        # Heads are inferred from the width, so a tensor-parallel slice of them works too.
        q, k, v = (p(x).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PlainLM(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


register_model("plain", lambda shape: PlainLM(**shape), {"tiny": dict(vocab=256, dim=64, depth=2)})

register_plan(Plan(
    name="plain",
    blocks="blocks.*",
    tensor_parallel={
        "blocks.*.attention.q": ColwiseParallel(),
        "blocks.*.attention.k": ColwiseParallel(),
        "blocks.*.attention.v": ColwiseParallel(),
        "blocks.*.attention.out": RowwiseParallel(),
        "blocks.*.up": ColwiseParallel(),
        "blocks.*.down": RowwiseParallel(),
    },
    output="head",
    shard_units={"blocks.*.attention.*": lambda model: HEAD_DIM},
    # Pipeline stages: the embedding runs first, norm and head last, each on what the one
    # before returns; every block takes the hidden state alone. The defaults do the rest.
    stages=Stages(first=("embed",), last=("norm", "head")),
))
