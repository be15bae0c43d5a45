"""The smallest program that shows torch 2.13's compile + activation checkpointing + TP
failure, and the engine's workaround (parallel/apply.py: checkpoint_policy).

usage: torchrun --nproc_per_node 2 tests/compile_ac_tp_repro.py [--without-fix]

One attention module, its projections split by tensor parallel over 2 ranks, the
forward checkpointed and then compiled. On torch 2.13, without the fix, the first
forward raises "AssertionError: expected all tensors_saved_with_vc_check to be
Tensors ... DeviceMesh": SDPA draws random numbers (it is tagged
nondeterministic_seeded, dropout or not), so AOT autograd saves its RNG state to
replay it in the recomputation, and it appends that state after the DeviceMesh that
the DTensor weights bring into the graph; the saved values are then read back one
slot off. With the fix the checkpoint keeps SDPA's output instead of recomputing it.
Prints one JSON line on rank 0: the error, or the largest gradient difference
against the same module run eagerly on one process.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallel.apply import checkpoint_block, checkpoint_policy  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48, bias=False)  # 4 heads of 4, laid out (head, q|k|v, 4)
        self.out = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (-1, 3, 4)).permute(3, 0, 2, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def main(with_fix: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Attention()
    reference = copy.deepcopy(model)
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                       {"qkv": ColwiseParallel(), "out": RowwiseParallel()})
    checkpoint_block(model, checkpoint_policy(op_level=False, compiled=True) if with_fix else None)
    model.compile()
    x = torch.randn(2, 8, 16)
    reference(x).pow(2).sum().backward()
    try:
        model(x).pow(2).sum().backward()
        diff = max((p.grad.full_tensor() - r.grad).abs().max().item()
                   for p, r in zip(model.parameters(), reference.parameters()))
        result = {"torch": torch.__version__, "max_grad_diff": diff}
    except AssertionError as err:
        result = {"torch": torch.__version__, "error": str(err)[:200]}
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(with_fix="--without-fix" not in sys.argv[1:])
    exit_without_teardown(0)
