"""A parallelize plan written the way a user writes one for their own model: only the
public plan API (parallel.plan) and torch's tensor-parallel styles, no engine edits.

Load it with:  --set model.name=gpt2 --set parallel.plan=gpt2 --set model.plugin=examples.gpt2_plan
"""

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from parallel.plan import Plan, Stages, register_plan


def embed(model, tokens, positions):
    """The first pipeline stage's computation before the blocks: token and position
    embeddings (`positions`: the tokens' own under context parallelism, else None)."""
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
    return model.wte(tokens) + model.wpe(positions)

register_plan(Plan(
    name="gpt2",
    blocks="blocks.*",
    tensor_parallel={
        # Vocabulary rows split across TP ranks; the output projection shares this weight.
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # Whole heads per rank: the fused qkv is laid out head by head.
        "blocks.*.attn.c_attn": ColwiseParallel(),
        "blocks.*.attn.c_proj": RowwiseParallel(),
        "blocks.*.mlp.c_fc": ColwiseParallel(),
        "blocks.*.mlp.c_proj": RowwiseParallel(),
    },
    # No sequence-parallel variant: learned positions are added to the full sequence.
    output="lm_head",
    shard_units={
        "blocks.*.attn.c_attn": lambda model: 3 * model.args.head_dim,
        "blocks.*.attn.c_proj": lambda model: model.args.head_dim,
    },
    # The attention core (q, k, v -> causal attention): with cp > 1 the engine attends across
    # the cp ranks in its place, and passes the model its tokens' positions.
    attention="blocks.*.attn.core",
    # Pipeline stages: the embeddings are added, not run one after the other, so the first
    # stage's computation is given; the last stage runs ln_f then lm_head, the default. The
    # output projection shares wte's weight: on different stages, each holds a copy that
    # the engine keeps equal.
    stages=Stages(first=("wte", "wpe"), last=("ln_f", "lm_head"), embed=embed),
))
