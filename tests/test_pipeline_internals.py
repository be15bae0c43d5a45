"""parallel/pipeline_internals.py on the torch that runs the suite (`make test-compat` runs
it on the oldest and the newest): a pipeline stage holds a message's tensor only while
its micro-batch needs it.

Receive buffers: each case is one rank of a 2-rank pipeline in a process of its own,
over torch's fake process group (messages return at once; the received values are
whatever the buffer held, which does not matter here): a stage of two linear layers,
1F1B over 8 micro-batches, two steps. The stage's receive descriptors are read before
every forward and backward: how many hold a real buffer then, and after the step.

Forward sends: a real 2-rank gloo run (torchrun) of Interleaved1F1B, 2 stages per rank,
4 micro-batches, whose runtime keeps the Work of every send until the step ends, and a
gloo Work keeps the tensor it sent. After each backward on rank 0, the tensors that rank
0's stages sent forward for the micro-batches whose backward is done must be gone.

With torch's own stage and schedule before 2.15 each case finds what it must not (all 8
buffers; every sent tensor until the step ends), so each assertion can fail; the real
pipelined runs of tests/test_pipeline.py and tests/test_dryrun.py check that nothing
else changes.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MICRO_BATCHES = 8


def _real_buffers(infos) -> int:
    import torch
    return sum(isinstance(getattr(info, "buffer", None), torch.Tensor) and not info.buffer.is_meta
               for info in infos)


def run_stage(rank: int, lazy: bool) -> dict:
    """One rank of the 1F1B pipeline over the fake process group, two steps; what its
    receive descriptors held."""
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
    from tests.distributed import call_in_own_process
    return call_in_own_process("tests.test_pipeline_internals:run_stage", rank, lazy)


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
    2.15 that is torch's own stage; before, ReleasingStage."""
    lazy = _in_own_process(rank, lazy=True)
    # From 2.15 the stage's computation takes the buffer out of its descriptor at once.
    in_use = 0 if lazy["torch_allocates_on_receive"] else 1
    assert lazy["during"][kind] == in_use and lazy["after"][kind] == 0, lazy
    stock = _in_own_process(rank, lazy=False)
    if not stock["torch_allocates_on_receive"]:  # torch's stage before 2.15: every micro-batch's, always
        assert stock["during"][kind] == MICRO_BATCHES and stock["after"][kind] == MICRO_BATCHES, stock


def sends_worker(out: str, lazy: str) -> None:
    """Rank r of the gloo run (torchrun, 2 ranks): after each backward on rank 0, how many of
    the tensors rank 0 sent forward for micro-batches already through their backward there
    are still alive."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from engine.dryrun import torch_internals
    from parallel import pipeline_internals

    dist.init_process_group("gloo")
    rank, micro_batches = dist.get_rank(), 4
    torch.manual_seed(0)
    example = torch.zeros(2, 64, requires_grad=True)
    stage_class = pipeline_internals.stage_class() if lazy == "lazy" else PipelineStage
    stages = [stage_class(nn.Linear(64, 64), index, 4, torch.device("cpu"), input_args=example,
                          output_args=example.detach().requires_grad_()) for index in (rank, rank + 2)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=micro_batches, loss_fn=lambda out, _: out.sum(),
                                       scale_grads=False)
    if lazy == "lazy":
        schedule = pipeline_internals.releasing_forward_sends(schedule)
    sent, done, alive_after_backward = {}, set(), []
    for stage in stages:
        get_ops, backward = stage.get_fwd_send_ops, stage.backward_one_chunk

        def record_sends(chunk, stage=stage, get_ops=get_ops):
            ops = get_ops(chunk)
            sent.setdefault((stage.stage_index, chunk), []).extend(weakref.ref(op.tensor) for op in ops)
            return ops

        def count_after(chunk, *args, stage=stage, backward=backward, **kwargs):
            result = backward(chunk, *args, **kwargs)
            done.add((stage.stage_index, chunk))
            alive_after_backward.append(sum(ref() is not None for key in done for ref in sent.get(key, ())))
            return result

        stage.get_fwd_send_ops, stage.backward_one_chunk = record_sends, count_after
    with torch_internals.pipeline_warmup_without_messages():
        for _ in range(2):
            if rank == 0:
                schedule.step(torch.zeros(2 * micro_batches, 64))
            else:
                schedule.step(target=torch.zeros(2 * micro_batches, 64), losses=[])
            sent.clear()
            done.clear()
    if rank == 0:
        Path(out).write_text(json.dumps({"alive_after_backward": alive_after_backward,
                                         "torch_releases_sends": pipeline_internals.allocates_on_receive()}))
    dist.destroy_process_group()


@pytest.mark.compat
@pytest.mark.distributed
def test_a_forward_send_is_let_go_at_its_micro_batch_backward(tmp_path):
    from tests.distributed import torchrun
    found = {}
    for lazy in ("lazy", "stock"):
        result = torchrun(2, __file__, str(tmp_path / f"{lazy}.json"), lazy, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        found[lazy] = json.loads((tmp_path / f"{lazy}.json").read_text())
    lazy, stock = found["lazy"], found["stock"]
    # Rank 0 holds stages 0 and 2 of 4, each sending forward: 8 backwards and 8 sends a step.
    # torch 2.15's schedule waits for its sends at points of its own: here one done
    # micro-batch's send at most is alive when its backward returns, never more.
    held = 1 if lazy["torch_releases_sends"] else 0
    assert len(lazy["alive_after_backward"]) == 16 and max(lazy["alive_after_backward"]) == held, lazy
    if not stock["torch_releases_sends"]:  # torch's schedule before 2.15 holds them to the step's end
        assert stock["alive_after_backward"][7] == 8, stock


if __name__ == "__main__":  # under torchrun: tests/test_pipeline_internals.py OUT lazy|stock
    sends_worker(*sys.argv[1:3])
