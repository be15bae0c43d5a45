"""A parallelize plan written the way a user writes one for their own model: only the
public plan API (parallel.plan) and torch's tensor-parallel styles, no engine edits.

Load it with:  --set model.name=gpt2 --set parallel.plan=gpt2 --set model.plugin=examples.gpt2_plan
"""

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from parallel.plan import Plan, register_plan

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
))
