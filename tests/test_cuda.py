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

MOE = ("model.name=llama_moe", "model.flavor=debug-moe", "parallel.plan=llama_moe")

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
    # The mixture of experts: fp32 loops over the experts, bf16 runs the grouped GEMM
    # (test_grouped_experts_match_the_loop_on_cuda checks that one against the loop).
    "moe": MOE,
    "moe-bf16": (*MOE, "parallel.param_dtype=bfloat16"),
    "moe-compile-ac-bf16": (*MOE, "parallel.param_dtype=bfloat16", "parallel.compile=true",
                            "parallel.activation_checkpoint=selective", "moe.load_balance=0.01"),
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


def test_grouped_experts_match_the_loop_on_cuda():
    """The grouped GEMM on the GPU, on token groups of uneven sizes (empty and odd ones
    among them, none a multiple of 8), against the loop over experts and an fp32 loop:
    forward and backward in bf16, each within twice the loop's own distance from fp32."""
    from models.moe import Experts, MoEArgs, grouped_gemm_works
    device = torch.device("cuda")
    assert grouped_gemm_works(device, torch.bfloat16), "torch._grouped_mm does not run in bf16 on this GPU"
    torch.manual_seed(0)
    experts = Experts(MoEArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=512, vocab_size=64,
                                     max_seq_len=64, n_experts=8, top_k=2, expert_hidden=192)).to(device)
    counts = torch.tensor([0, 1, 7, 33, 0, 129, 5, 83], device=device)
    x = torch.randn(int(counts.sum()), 256, device=device)
    weights = (torch.randn_like(experts.w13) * 0.05, torch.randn_like(experts.w2) * 0.05)
    grad = torch.randn(x.shape, device=device)

    def run(dtype, grouped):
        experts.grouped_dtypes = frozenset({dtype}) if grouped else frozenset()
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, *weights)]
        out = experts.compute(leaves[0], counts, *leaves[1:])
        out.backward(grad.to(dtype))
        return [out.float()] + [t.grad.float() for t in leaves]

    reference, loop, grouped = run(torch.float32, False), run(torch.bfloat16, False), run(torch.bfloat16, True)
    for name, ref, looped, got in zip(("output", "x grad", "w13 grad", "w2 grad"), reference, loop, grouped):
        limit = 2 * (looped - ref).abs().max() + 1e-3 * ref.abs().max()
        assert (got - ref).abs().max() <= limit, (name, (got - ref).abs().max().item(), limit.item())

