"""parallel/pipeline_internals.py on the torch that runs the suite (`make test-compat` runs
it on the oldest and the newest): a pipeline stage holds a real receive buffer only while
its micro-batch needs it.

Each case is one rank of a 2-rank pipeline in a process of its own, over torch's fake
process group (collectives and messages return at once; the received values are
whatever the buffer held, which the step does not need to be right for this): a stage of
two linear layers, 1F1B over 8 micro-batches, two steps. The stage's receive
descriptors are read before every forward and backward of the step: how many hold a real
buffer then, and after the step. With torch's own stage before 2.15 all 8 are real from
the first step on, so each assertion can fail; the real pipelined runs of
tests/test_pipeline.py and tests/test_dryrun.py check that nothing else changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MICRO_BATCHES = 8


def _real_buffers(infos) -> int:
    import torch
    return sum(isinstance(getattr(info, "buffer", None), torch.Tensor) and not info.buffer.is_meta
               for info in infos)


def run_stage(rank: int, lazy: bool) -> dict:
    """One rank of the pipeline, two steps; what its receive descriptors held."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from engine.dryrun import torch_internals
    from parallel import pipeline_internals

    torch_internals.start_fake_world(2, rank)
    torch.manual_seed(0)
    part = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    example = torch.zeros(2, 16, requires_grad=True)
    stage_class = pipeline_internals.stage_class() if lazy else PipelineStage
    stage = stage_class(part, rank, 2, torch.device("cpu"), input_args=example, output_args=example.detach()
                        .requires_grad_())
    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=lambda out, _: out.sum(),
                            scale_grads=False)
    seen = {"forward": 0, "backward": 0}

    def count(_module, *_):
        seen["forward"] = max(seen["forward"], _real_buffers(i for c in stage.args_recv_info.values() for i in c))
        seen["backward"] = max(seen["backward"], _real_buffers(i for c in stage.grad_recv_info.values() for i in c))

    part.register_forward_pre_hook(count)
    part[0].register_full_backward_pre_hook(lambda *args: count(None))
    inputs = torch.zeros(2 * MICRO_BATCHES, 16)
    with torch_internals.pipeline_warmup_without_messages():  # the stages' shapes are given
        for _ in range(2):
            if rank == 0:
                schedule.step(inputs)
            else:
                schedule.step(target=torch.zeros(2 * MICRO_BATCHES, 16), losses=[])
    after = {"forward": _real_buffers(i for c in stage.args_recv_info.values() for i in c),
             "backward": _real_buffers(i for c in stage.grad_recv_info.values() for i in c)}
    dist.destroy_process_group()
    return {"during": seen, "after": after, "torch_allocates_on_receive": pipeline_internals.allocates_on_receive()}


def _in_own_process(rank: int, lazy: bool) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); "
            f"from tests.test_pipeline_internals import run_stage; print(json.dumps(run_stage({rank}, {lazy})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_internals_the_engine_uses_are_there():
    from parallel import pipeline_internals
    assert pipeline_internals.missing_internals() == []
    pipeline_internals.check_supported()


@pytest.mark.compat
@pytest.mark.parametrize("rank, kind", [(1, "forward"), (0, "backward")],
                         ids=["last stage: received activations", "first stage: received gradients"])
def test_a_stage_holds_a_receive_buffer_only_while_its_micro_batch_is_in_flight(rank, kind):
    """1F1B at pp=2: the last stage has at most one received activation in use at a time
    (each forward is followed by its backward), the first stage one received gradient; the
    other 7 micro-batches' buffers are not held, during the step or after it. From torch
    2.15 that is torch's own stage; before, LazyReceiveStage."""
    lazy = _in_own_process(rank, lazy=True)
    # From 2.15 the stage's computation takes the buffer out of its descriptor at once.
    in_use = 0 if lazy["torch_allocates_on_receive"] else 1
    assert lazy["during"][kind] == in_use and lazy["after"][kind] == 0, lazy
    stock = _in_own_process(rank, lazy=False)
    if not stock["torch_allocates_on_receive"]:  # torch's stage before 2.15: every micro-batch's, always
        assert stock["during"][kind] == MICRO_BATCHES and stock["after"][kind] == MICRO_BATCHES, stock
