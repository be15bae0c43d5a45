"""The parallelize plan for models.llama: blocks and tensor-parallel styles as data."""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from parallel.plan import Plan, Stages, register_plan

def rope_block(model, block, h, positions):
    """One block of a pipeline stage: it reads the RoPE tables, at `positions` if given."""
    cos, sin = model.rope_cos, model.rope_sin
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    return block(h, cos, sin)


LLAMA = register_plan(Plan(
    name="llama",
    blocks="layers.*",
    tensor_parallel={
        # The vocabulary is split across TP ranks; each rank embeds its rows and the
        # partial results are summed, so every rank gets the full hidden state.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # Heads are split: q, k, v by output features, wo by input features.
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        # The hidden dimension of the MLP is split the same way.
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
    },
    sequence_parallel={
        # Outside attention and MLP the hidden states stay split by sequence position,
        # so the norms run on a slice and hold no full activations.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.ffn_norm": SequenceParallel(),
        "norm": SequenceParallel(),
        # Attention and MLP gather the sequence on entry and scatter it on exit.
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    },
    output="output",
    # q, k, v and wo must split into whole heads: kv heads bound the TP degree.
    shard_units={"layers.*.attention.w?": lambda model: model.args.head_dim},
    # Recomputed in backward but for their matmuls and attention: a norm keeps only its
    # input, attention and the MLP the shard they are given, SwiGLU the outputs of w1 and w3.
    sublayers=("layers.*.attention_norm", "layers.*.attention", "layers.*.ffn_norm", "layers.*.feed_forward"),
    # Each norm's output is read by its attention or MLP alone: computed again from the
    # residual stream before that sublayer's backward.
    recomputed_outputs=("layers.*.attention_norm", "layers.*.ffn_norm"),
    # Context parallelism attends across ranks in place of this module.
    attention="layers.*.attention.core",
    # Pipeline stages: the embedding first, the final norm and output last; every block
    # also reads the RoPE tables, which each stage keeps as buffers (at its tokens'
    # positions under context parallelism).
    stages=Stages(first=("tok_embeddings",), last=("norm", "output"), block=rope_block),
))
