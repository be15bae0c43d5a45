"""The core loop on real torchrun/gloo launches (worker: tests/loop_worker.py), one launch
per mesh, several checks per launch.

- Prefetch (dp=2, 4 blocks; units are numbered in forward order, 0 = root): at forward
  depth N the root and each block issue the all-gathers of the next N blocks before their
  own compute, and no further; depth 0 issues each block's all-gather in its own
  pre-forward. In backward, FSDP2's implicit schedule prefetches one block; depth 2 two.
  `unshard_ahead` N gathers the root and the first N blocks before the batch exists.
  Every depth gives bitwise the same step-0 loss and gradients and the same next losses.
  The same leads and the same bitwise equality are required with activation checkpointing
  on (prefetch_ac), where each block's forward runs again inside its backward.
  A plan's own block order (Plan.prefetch_order) is the one prefetch follows.
- Accumulation: one gradient reduction per FSDP unit per step with 1 or 4 micro-batches;
  4 micro-batches against the reference's one big batch: loss and every gradient within
  1e-5 absolute, the next losses (AdamW) within 1e-4.
- Norm and clipping on dp, hsdp, dp x tp without and with sequence parallel (without SP the
  norm weights sit on a different mesh from the rest): 2- and inf-norm within 1e-5
  relative of torch's on one process; gradients clipped to a quarter of the norm within
  1e-5 absolute of torch's clip_grad_norm_.
- Neutrality (dp=2,tp=2 launch): AC none/full/selective/op on that mesh, and
  reshard_after_forward true/false/2 on dp=4 over the same ranks, give bitwise the same
  step-0 loss and full gradients.
- Memory: the largest figure over ranks, reduced in the background while another
  collective runs, reaches every rank.
"""

import json
import math

import pytest

from tests.distributed import REPO, torchrun

NPROC = {"dp=2": 2, "hsdp=2,dp=2": 4, "dp=2,tp=2": 4}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """mesh -> the worker's report; each mesh is launched once, on first use."""
    done = {}

    def report(mesh: str) -> dict:
        if mesh not in done:
            out = tmp_path_factory.mktemp("loop") / "report.json"
            result = torchrun(NPROC[mesh], REPO / "tests" / "loop_worker.py", mesh, str(out))
            assert result.returncode == 0, result.stderr[-4000:]
            done[mesh] = json.loads(out.read_text())
        return done[mesh]
    return report


def expected_forward_lead(depth: int, blocks: int) -> list[int]:
    return [min(depth, blocks - unit) for unit in range(blocks + 1)]


@pytest.mark.distributed
@pytest.mark.parametrize("ac", ["prefetch", "prefetch_ac"])
def test_prefetch_issues_all_gathers_ahead_by_the_depth(reports, ac):
    prefetch = reports("dp=2")[ac]
    blocks = prefetch["blocks"]
    assert blocks == 4  # the debug model: enough blocks that depth 2 stops short of the end
    assert prefetch["depth0"]["forward_lead"] == [0] * (blocks + 1)
    for depth in (1, 2):
        assert prefetch[f"depth{depth}"]["forward_lead"] == expected_forward_lead(depth, blocks)
    # Backward, listed from the last block down: unit u prefetches down to unit 1 at most.
    assert prefetch["depth0"]["backward_lead"] == [min(1, unit - 1) for unit in range(blocks, 0, -1)]
    assert prefetch["depth2"]["backward_lead"] == [min(2, unit - 1) for unit in range(blocks, 0, -1)]
    assert prefetch["depth0"]["gathered_before_batch"] == []
    for depth in (1, 2):
        assert prefetch[f"depth{depth}"]["gathered_before_batch"] == list(range(depth + 1))


@pytest.mark.distributed
def test_prefetch_follows_a_plans_custom_order(reports):
    # Blocks run 0..3 (units 1..4) but the plan lists them as 1, 0, 3, 2 (units 2, 1, 4, 3),
    # and prefetch follows the list literally: the root gathers itself and prefetches unit 2;
    # block 0 gathers itself (1) and prefetches 4; block 1 prefetches 1 again, already
    # resharded after its forward; block 2 gathers itself (3); block 3 prefetches 3 again.
    # The wasted re-gathers are why a plan must give the real execution order.
    assert reports("dp=2")["prefetch"]["custom_order_all_gathers"] == [0, 2, 1, 4, 1, 3, 3]


@pytest.mark.distributed
@pytest.mark.parametrize("ac", ["prefetch", "prefetch_ac"])
def test_prefetch_changes_nothing_numerically(reports, ac):
    for depth in (1, 2):
        assert reports("dp=2")[ac][f"depth{depth}"]["bitwise_equal_to_depth0"] == {
            "loss0": True, "grads0": True, "losses": True}


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", NPROC)
def test_accumulation_reduces_once_per_step_and_matches_one_big_batch(reports, mesh):
    acc = reports(mesh)["accumulation"]
    assert acc["reduce_scatters_mb1"] == acc["units"]
    assert acc["reduce_scatters_mb4"] == acc["units"]
    assert acc["loss0_diff"] <= 1e-5
    assert acc["grad_max_diff"] <= 1e-5
    for ours, reference in zip(acc["losses"], acc["ref_losses"], strict=True):
        assert abs(ours - reference) <= 1e-4


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", NPROC)
def test_grad_norm_and_clipping_match_one_process(reports, mesh):
    report = reports(mesh)
    for plan, norms in report["norms"].items():
        for norm_type in ("2.0", "inf"):
            ours, reference = norms[f"norm_{norm_type}"]
            assert math.isclose(ours, reference, rel_tol=1e-5), (plan, norm_type, ours, reference)
        assert norms["clipped_grad_max_diff"] <= 1e-5, plan
        assert math.isclose(norms["clipped_norm"], norms["max_norm"], rel_tol=1e-4), plan
    if mesh == "dp=2,tp=2":
        # Without SP the norm weights live on the dp mesh alone; with SP everything is on (dp, tp).
        assert report["norms"]["llama"]["meshes"] == ["('dp', 'tp')", "('dp',)"]
        assert report["norms"]["llama_sp"]["meshes"] == ["('dp', 'tp')"]


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", NPROC)
def test_memory_is_the_largest_over_ranks_on_every_rank(reports, mesh):
    memory = reports(mesh)["memory"]
    assert len(memory["seen"]) == NPROC[mesh]
    for seen in memory["seen"]:
        assert seen == {"memory": memory["expected_memory"], "loss": memory["expected_loss"]}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_activation_checkpointing_is_bitwise_neutral(reports, mode):
    neutrality = reports("dp=2,tp=2")["neutrality"]
    assert neutrality[f"ac_{mode}"] == neutrality["ac_none"]
    assert len(neutrality["ac_none"]["grads"]) == 4 * 9 + 3


@pytest.mark.distributed
@pytest.mark.parametrize("setting", ["False", "2"])
def test_reshard_setting_is_bitwise_neutral(reports, setting):
    neutrality = reports("dp=2,tp=2")["neutrality"]
    assert neutrality[f"reshard_{setting}"] == neutrality["reshard_True"]
