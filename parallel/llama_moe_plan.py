"""The parallelize plan for models.moe (model llama_moe): Llama's, but for the feed-forward.

Until expert parallelism splits them, the experts and their router are not split by
tensor parallel: each tp rank runs the whole MoE on the full sequence, which it is given
whole (tokens route one by one, so nothing else would change). With sequence parallel,
the MoE gathers the sequence on entry and keeps its rank's part on exit; each tp rank then
computes the same gradients for the experts, so none need summing over tp.
"""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from parallel.llama_plan import LLAMA
from parallel.plan import Plan, register_plan


def _without_feed_forward(styles: dict) -> dict:
    return {path: style for path, style in styles.items() if ".feed_forward" not in path}


LLAMA_MOE = register_plan(Plan(
    name="llama_moe",
    blocks=LLAMA.blocks,
    tensor_parallel=_without_feed_forward(LLAMA.tensor_parallel),
    sequence_parallel={
        **_without_feed_forward(LLAMA.sequence_parallel),
        "layers.*.feed_forward": PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True),
    },
    output=LLAMA.output,
    shard_units=LLAMA.shard_units,
    sublayers=LLAMA.sublayers,
    recomputed_outputs=LLAMA.recomputed_outputs,
    attention=LLAMA.attention,
    stages=LLAMA.stages,
    # The router's gate (dim x experts) decides where each token goes; float8 would move
    # those decisions, and its width is below float8's multiple of 16 in the small flavors.
    float8_skip=("layers.*.feed_forward.router.gate",),
    experts="layers.*.feed_forward.experts",
))
