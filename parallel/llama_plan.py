"""The parallelize plan for models.llama: blocks and tensor-parallel styles as data."""

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from parallel.plan import Plan, register_plan

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
        "output": ColwiseParallel(output_layouts=Replicate()),
    },
))
