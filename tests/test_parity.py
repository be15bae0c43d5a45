"""The parity matrix: every plan feature against a single-process reference.

Each row is one real torchrun launch over gloo on the CPU (tests/parity_worker.py,
run once per session and shared by the tests below). Tolerances, by dtype:

fp32  initial weights bitwise equal (layout-independent init); step-0 loss and every
      full gradient within 1e-5 absolute; grad norm (2 and inf) within 1e-5 relative;
      the next two losses within 1e-4 (AdamW amplifies reduction-order noise).
bf16  (param_dtype=bfloat16, fp32 reduction) against a reference that also computes in
      bf16 from fp32 master weights: step-0 loss within 1e-2, every gradient within
      8e-3 x the largest gradient (two bf16 steps at that magnitude), grad norm within
      1e-2 relative, later losses within 1e-2.
"""

import math

import pytest
import torch

from tests.distributed import parity_report

GPT2 = ("model.name=gpt2", "parallel.plan=gpt2", "model.plugin=examples.gpt2_plan")

# id: (mesh, ranks, overrides, flavor)
MATRIX = {
    "dp": ("dp=4", 4, (), "debug"),
    "hsdp": ("hsdp=2,dp=2", 4, (), "debug"),
    "dp-tp": ("dp=2,tp=2", 4, (), "debug"),
    "dp-tp-sp-lossparallel": ("dp=2,tp=2", 4, ("parallel.sequence_parallel=true",
                                               "parallel.loss_parallel=true"), "debug"),
    "hsdp-tp": ("hsdp=2,dp=2,tp=2", 8, (), "debug"),
    "hsdp-tp-sp": ("hsdp=2,tp=2", 4, ("parallel.sequence_parallel=true",), "debug"),
    "tied-embeddings-tp": ("dp=2,tp=2", 4, (), "debug_tied"),
    "reshard-false-dp": ("dp=4", 4, ("parallel.reshard_after_forward=false",), "debug"),
    "reshard-2-dp": ("dp=4", 4, ("parallel.reshard_after_forward=2",), "debug"),
    "reshard-2-hsdp": ("hsdp=2,dp=4", 8, ("parallel.reshard_after_forward=2",), "debug"),
    "reshard-2-dp-tp-sp": ("dp=4,tp=2", 8, ("parallel.reshard_after_forward=2",
                                            "parallel.sequence_parallel=true"), "debug"),
    "ac-full": ("dp=2,tp=2", 4, ("parallel.activation_checkpoint=full",), "debug"),
    "ac-selective": ("dp=2,tp=2", 4, ("parallel.activation_checkpoint=selective",), "debug"),
    "ac-op": ("dp=2,tp=2", 4, ("parallel.activation_checkpoint=op",), "debug"),
    "compile-tp": ("dp=2,tp=2", 4, ("parallel.compile=true",), "debug"),
    "bf16": ("dp=4", 4, ("parallel.param_dtype=bfloat16",), "debug"),
    "offload": ("dp=2,tp=2", 4, ("parallel.offload=true",), "debug"),
    "gpt2-user-plan": ("dp=2,tp=2", 4, GPT2, "debug"),
}


@pytest.fixture(scope="session")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")

    def get(case: str):
        mesh, ranks, overrides, flavor = MATRIX[case]
        return parity_report(root, mesh, ranks, *overrides, flavor=flavor)
    return get


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(MATRIX))
def test_matches_single_process_reference(reports, case):
    report, _ = reports(case)
    bf16 = "parallel.param_dtype=bfloat16" in MATRIX[case][2]
    assert report["init_max_diff"] == 0.0
    assert report["loss0_diff"] <= (1e-2 if bf16 else 1e-5)
    grad_tolerance = 8e-3 * report["grad_max_abs"] if bf16 else 1e-5
    assert report["grad_max_diff"] <= grad_tolerance, report["worst_grad"]
    for norm_type in ("2.0", "inf"):
        ours, reference = report[f"grad_norm_{norm_type}"]
        assert math.isclose(ours, reference, rel_tol=1e-2 if bf16 else 1e-5), (norm_type, ours, reference)
    for ours, reference in zip(report["losses"], report["ref_losses"]):
        assert abs(ours - reference) <= (1e-2 if bf16 else 1e-4)


def assert_bitwise_equal(first, second):
    (report_a, grads_a), (report_b, grads_b) = first, second
    assert report_a["losses"] == report_b["losses"]
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["ac-full", "ac-selective", "ac-op"])
def test_activation_checkpointing_is_bitwise_neutral(reports, case):
    assert_bitwise_equal(reports("dp-tp"), reports(case))


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["reshard-false-dp", "reshard-2-dp"])
def test_reshard_setting_is_bitwise_neutral(reports, case):
    assert_bitwise_equal(reports("dp"), reports(case))


@pytest.mark.distributed
def test_integer_reshard_really_reshards_onto_groups_of_two(reports):
    """After forward, block parameters live on the (groups, 2, tp) post-forward mesh,
    sharded over 2 ranks instead of 4: the layout an integer reshard promises."""
    after = reports("reshard-2-dp-tp-sp")[0]["after_forward"]
    mesh, placements, local_shape = after["attention.wq.weight"]
    assert mesh == "(2, 2, 2)"
    assert placements[0] == "R" and placements[1].startswith("_S(0") and placements[2] == "S(0)"
    assert local_shape == [256 // 2 // 2, 256]  # tp halves the rows, the group of 2 halves them again
    mesh, placements, local_shape = after["ffn_norm.weight"]  # SP: the norm is replicated over tp
    assert (mesh, placements, local_shape) == ("(2, 2, 2)", ["R", "S(0)", "R"], [128])
    mesh, _, local_shape = reports("dp")[0]["after_forward"].get("attention.wq.weight", [None, None, None])
    assert mesh == "(4,)" and local_shape == [64, 256]  # reshard=true: back to the full dp=4 shard
