"""The generated combination matrix (tests/combinations.py), each row one real
`launch/run.py --parity` run (over gloo on the CPU, 4 ranks; 8 for an integer reshard on
hsdp or on tp meshes and for hsdp x dp x tp; 16 for an integer reshard on hsdp x dp x
tp) against the single-device reference: the debug model at 2 blocks (4 with pipeline
parallel), 3 steps. Each row is held to the tolerances promised for its dtype
(tests/test_parity.py's docstring), whatever the command's own verdict.

The rows of one world size run one after another in one torchrun job
(tests/distributed.py: run_together), real processes and process groups, started once;
a row that job did not finish runs alone through the launcher. On torch before 2.13,
the ZBVZeroBubble rows must be refused instead (parallel/pipeline.py: runs_on_backend),
so there the pairs only they hold are checked on the newer versions alone."""

from itertools import combinations

import pytest

from tests.combinations import (FACTORS, MESHES, PIPELINE_MESHES, ROWS, STEPS, ZERO_BUBBLE, _pairs, all_pairs, allowed,
                                layers_of, mesh_of, overrides)
from parallel.pipeline import runs_on_backend
from tests.distributed import launcher, parity_report, run_together, selected
from tests.test_parity import assert_within_promised_tolerances


def test_every_pair_of_values_appears_in_some_row():
    covered = set().union(*(_pairs(row) for row in ROWS))
    assert set(all_pairs()) <= covered
    assert all(allowed(row) for row in ROWS)
    assert (len(ROWS), len(all_pairs())) == (23, 691)  # docs/parallelism.md quotes both


def test_only_the_pairs_no_valid_row_can_hold_are_left_out():
    possible = sum(len(FACTORS[a]) * len(FACTORS[b]) for a, b in combinations(FACTORS, 2))
    without_tp = [kind for kind in MESHES if "tp" not in kind]
    schedules = [value for value in FACTORS["pipeline"] if value != "off"]
    left_out = (len(without_tp) * 2  # (dp or hsdp) x (sequence_parallel or loss_parallel = true)
                + len(schedules) * 2  # a schedule x (hsdp x dp x tp, or an integer reshard): 8 ranks or more
                + len(ZERO_BUBBLE) * 3  # zero bubble x (reshard true, compile, op-level AC)
                + 1)  # 1F1B x one micro-batch, fewer than its 2 stages
    assert possible - len(all_pairs()) == left_out
    assert set(PIPELINE_MESHES) == set(MESHES) - {"hsdp-dp-tp"}


@pytest.fixture(scope="session")
def row_report(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("combinations")
    run_together(root, [(mesh_of(ROWS[i]), overrides(ROWS[i]), STEPS) for i in selected(request.session, __name__, "index")
                        if runs_here(ROWS[i])])
    return lambda index: parity_report(root, mesh_of(ROWS[index]), *overrides(ROWS[index]), steps=STEPS)


@pytest.mark.distributed
@pytest.mark.compat
@pytest.mark.parametrize("index", range(len(ROWS)))
def test_combination_row_passes_parity(row_report, index, tmp_path):
    if not runs_here(ROWS[index]):  # ZBVZeroBubble over gloo before torch 2.13: refused, with the fix
        result = launcher("--parity", "--mesh", mesh_of(ROWS[index]), "--set", f"run.dir={tmp_path}",
                          *(arg for value in overrides(ROWS[index]) for arg in ("--set", value)))
        assert result.returncode == 2 and "cannot run over gloo" in result.stderr, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        return
    report, code = row_report(index)
    assert (code, report["verdict"]) == (0, "PASS"), [c for c in report["checks"] if not c["ok"]]
    assert_within_promised_tolerances(report, STEPS)
    layers = layers_of(ROWS[index])
    assert report["layers"] == layers
    # 9 tensors per block (4 attention, 3 MLP, 2 norms) and 3 outside (embedding, norm, output)
    assert len(report["gradient_digests"]) == layers * 9 + 3
    if ROWS[index]["pipeline"] != "off":
        assert report["pipeline"]["schedule"] == ROWS[index]["pipeline"]


def runs_here(row: dict) -> bool:
    return runs_on_backend(row["pipeline"], "gloo")


def rows_where(**wanted) -> list[int]:
    return [i for i, row in enumerate(ROWS) if all(row[k] == v for k, v in wanted.items())]


@pytest.mark.distributed
@pytest.mark.compat
@pytest.mark.parametrize("index", rows_where(reshard_after_forward="2"))
def test_integer_reshard_really_reshards_onto_groups_of_two(row_report, index):
    """After forward, block parameters live on groups of 2 ranks instead of the whole
    shard group: natively on meshes without tp, on the engine's (groups, 2, tp) mesh
    with tp. The layout an integer reshard promises, read from the first block."""
    row = ROWS[index]
    sizes = dict(item.split("=") for item in mesh_of(row).split(","))
    tp = int(sizes.get("tp", 1))
    groups = int(sizes.get("hsdp", 1)) * int(sizes.get("dp", 1)) * int(sizes.get("cp", 1)) // 2
    mesh, placements, local_shape = row_report(index)[0]["post_forward_layout"]["attention.wq.weight"]
    assert local_shape == [256 // tp // 2, 256]  # tp splits the rows, the group of 2 halves them again
    if tp == 1:
        assert (mesh, placements) == (f"({groups}, 2)", ["R", "S(0)"])
        return
    assert mesh == f"({groups}, 2, {tp})"
    assert placements[0] == "R" and placements[1].startswith("_S(0") and placements[2] == "S(0)"
    if row["sequence_parallel"]:  # the norm is replicated over tp
        norm = row_report(index)[0]["post_forward_layout"]["ffn_norm.weight"]
        assert norm == [f"({groups}, 2, {tp})", ["R", "S(0)", "R"], [128]]


@pytest.mark.distributed
@pytest.mark.compat
def test_reshard_true_returns_to_the_whole_shard_group(row_report):
    index = rows_where(mesh="dp", reshard_after_forward="true")[0]
    mesh, _, local_shape = row_report(index)[0]["post_forward_layout"]["attention.wq.weight"]
    assert mesh == "(4,)" and local_shape == [64, 256]
