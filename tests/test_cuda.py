"""The CUDA path: `launch/run.py --parity` on a GPU, one row per setting, each held to the
tolerances of tests/test_parity.py (fp32: 1e-5 on the step-0 loss and every gradient;
bf16: 1e-2 on the loss and 8e-3 x the largest gradient).

These need a CUDA GPU, so the main suite deselects them (setup.cfg) and bench/gpu.sh
runs them (`pytest -m cuda`). One GPU is enough: each row runs the whole engine
(fully_shard over one rank, compile, checkpointing, offload, prefetch) on CUDA/NCCL
against the single-device reference on the same GPU. Several ranks cannot share one GPU
(NCCL refuses it; gloo crashed with SIGSEGV on CUDA tensors, torch 2.11), so the rows of
SEVERAL_GPUS are deselected where the machine has fewer GPUs than their mesh needs
(tests/conftest.py); docs/benchmarks.md lists them as commands.
"""

import math
import re

import pytest
import torch

from tests.distributed import parity_report
from tests.test_parity import assert_within_promised_tolerances

pytestmark = pytest.mark.cuda

ONE_RANK = {
    "fp32": (),
    "compile": ("parallel.compile=true",),
    "ac-full": ("parallel.activation_checkpoint=full",),
    "ac-selective": ("parallel.activation_checkpoint=selective",),
    "ac-op": ("parallel.activation_checkpoint=op",),
    "bf16": ("parallel.param_dtype=bfloat16",),
    "offload": ("parallel.offload=true",),
    "accumulation": ("training.micro_batches=2",),
    "prefetch": ("prefetch.forward=1", "prefetch.backward=1", "prefetch.unshard_ahead=1"),
    "no-reshard": ("parallel.reshard_after_forward=false",),
    "compile-ac-bf16": ("parallel.compile=true", "parallel.activation_checkpoint=full",
                        "parallel.param_dtype=bfloat16"),
    # Float8 on the GPU's own float8 matmuls (torch._scaled_mm), against a reference whose
    # linears run the same recipe; held to the float8 bounds (engine/parity/compare.py).
    "float8-tensorwise": ("parallel.float8=tensorwise", "parallel.param_dtype=bfloat16"),
    "float8-rowwise": ("parallel.float8=rowwise", "parallel.param_dtype=bfloat16"),
    "float8-compile-ac": ("parallel.float8=rowwise", "parallel.param_dtype=bfloat16", "parallel.compile=true",
                          "parallel.activation_checkpoint=op"),
}


SEVERAL_GPUS = {
    "dp2-tp2-sp": ("dp=2,tp=2", ("parallel.sequence_parallel=true",)),
    "dp4-reshard2": ("dp=4", ("parallel.reshard_after_forward=2",)),
    "dp4-tp2-reshard2-sp": ("dp=4,tp=2", ("parallel.reshard_after_forward=2", "parallel.sequence_parallel=true")),
    "dp2-tp4-sp-loss-parallel": ("dp=2,tp=4", ("parallel.sequence_parallel=true", "parallel.loss_parallel=true")),
    "hsdp2-dp2-tp2-compile-ac-bf16": ("hsdp=2,dp=2,tp=2", ("parallel.compile=true", "parallel.activation_checkpoint=full",
                                                           "parallel.param_dtype=bfloat16")),
    "dp8-offload": ("dp=8", ("parallel.offload=true",)),
}


def ranks(mesh: str) -> int:
    return math.prod(int(size) for size in re.findall(r"=(\d+)", mesh))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("tests marked cuda need a CUDA GPU; the main suite deselects them (make test)")
    return tmp_path_factory.mktemp("cuda")


@pytest.mark.parametrize("case", ONE_RANK)
def test_one_rank_on_cuda_matches_one_device(root, case):
    report, code = parity_report(root, "dp=1", "parallel.device=cuda", *ONE_RANK[case])
    assert report["device"] == "cuda/nccl" and report["reference"].startswith("cuda")
    assert code == 0, report["checks"]
    assert_within_promised_tolerances(report)



@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.gpus(ranks(mesh)))
                                  for case, (mesh, _) in SEVERAL_GPUS.items()])
def test_several_gpus_match_one_device(root, case):
    mesh, overrides = SEVERAL_GPUS[case]
    report, code = parity_report(root, mesh, "parallel.device=cuda", *overrides)
    assert report["device"] == "cuda/nccl" and report["world_size"] == ranks(mesh)
    assert code == 0, report["checks"]
    assert_within_promised_tolerances(report)
