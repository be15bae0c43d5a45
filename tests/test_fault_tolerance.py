"""Fault-tolerant replica groups (parallel/replicas.py, launch/replica_groups.py).

The refusals run through the launcher's checks in this process. The runs are real: a
torchft Lighthouse and one torchrun job per replica group, each FSDP over gloo, started by
`python launch/run.py` as a user starts them; the plain hsdp run they are compared with is
one torchrun job of the same mesh.
"""

from __future__ import annotations

import json
import math
import socket
import sys

import pytest

from bench.fault_tolerance import (check_kill_and_rejoin, check_lighthouse_restart, kill_and_rejoin, records,
                                    the_lighthouse)
from tests.distributed import launcher
from tests.test_cli import assert_clean_error, assert_refused

FT = ("--set", "fault_tolerance.enabled=true")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the socket is


BAD_INPUT = [
    (["--mesh", "dp=4", *FT], ["has no hsdp dimension", "--mesh hsdp=2,dp=2"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--set", "fault_tolerance.group=2"], ["numbered 0 to 1"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--set", "fault_tolerance.min_groups=3"], ["no step could commit"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--set", "fault_tolerance.group=-1"], ["fault_tolerance.group"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--parity", "--max-restarts", "1"], ["restarts no replica group"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--resume", "--set", "run.dir=/nonexistent/ft"], ["holds no complete checkpoint"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--set", f"fault_tolerance.lighthouse=http://127.0.0.1:{closed_port()}"],
     ["does not answer", "torchft_lighthouse"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--set", "fault_tolerance.lighthouse=nowhere"], ["http://HOST:PORT"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--set", "fault_tolerance.lighthouse=http://127.0.0.1:1", "--max-restarts", "2"],
     ["is started again by its scheduler"]),
]


@pytest.mark.parametrize("args,fragments", BAD_INPUT)
def test_bad_fault_tolerance_settings_are_refused(args, fragments):
    assert_refused(args, *fragments)


def test_fault_tolerance_without_torchft_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    assert_refused(["--mesh", "hsdp=2,dp=2", *FT], "needs torchft", "pip install -e .[ft]")


def test_an_unreachable_lighthouse_exits_2_on_the_command_line():
    lighthouse = f"fault_tolerance.lighthouse=http://127.0.0.1:{closed_port()}"
    assert_clean_error(launcher("--mesh", "hsdp=2,dp=2", *FT, "--set", lighthouse, timeout=60), "does not answer")


def assert_equal_to_plain_hsdp(tmp_path, mesh: str, *settings: str) -> None:
    """`mesh` as fault-tolerant replica groups (min_groups=hsdp, so every group takes every step)
    against one plain torchrun job of the same mesh, float32. The gradient norm and the
    learning rate are equal to the last bit at every step, on every group: the gradients
    the optimizer applies are the same. The logged loss is the float32 sum of the data
    ranks' means, added in another order (the groups' sums, against gloo's over all data
    ranks), so it may differ in its last bits: within 4 float32 ulps."""
    common = ("--mesh", mesh, "--set", "training.steps=4", *settings)
    plain = launcher(*common, "--set", f"run.dir={tmp_path / 'plain'}", timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    groups = int(mesh.split("hsdp=")[1].split(",")[0])
    ft = launcher(*common, *FT, "--set", f"fault_tolerance.min_groups={groups}", "--set",
                  f"run.dir={tmp_path / 'ft'}", timeout=300)
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    expected = records(tmp_path / "plain")
    assert len(expected) == 4
    for group in range(groups):
        logged = [r for r in records(tmp_path / "ft" / f"group-{group}") if r["committed"]]
        assert all(r["groups"] == groups for r in logged), logged
        assert [(r["step"], r["grad_norm"], r["lr"]) for r in logged] == \
            [(r["step"], r["grad_norm"], r["lr"]) for r in expected]
        for record, reference in zip(logged, expected):
            assert math.isclose(record["loss"], reference["loss"], rel_tol=4 * 2**-23, abs_tol=0), \
                (record["loss"], reference["loss"])


@pytest.mark.distributed
@pytest.mark.compat
def test_fault_tolerant_groups_without_a_failure_equal_plain_hsdp(tmp_path):
    """Two torchrun jobs of 2 ranks joined by torchft against one job of 4 ranks."""
    assert_equal_to_plain_hsdp(tmp_path, "hsdp=2,dp=2")


# Replica groups beside each other dimension, each a plain job and a fault-tolerant one
# (about 70 s in all): the long drills, so that `make test` stays under 15 minutes; the
# combination matrix's fault-tolerant rows meet pp, cp, tp and ep too, against one device.
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mesh,settings", [
    ("pp=2,hsdp=2,tp=2", ("--set", "training.micro_batches=2")),  # every stage's FSDP units average
    ("hsdp=2,dp=2,cp=2", ()),
    ("hsdp=3,dp=1", ("--set", "training.global_batch=15")),  # an FSDP unit over one rank, three groups
    # A mixture of experts split over ep=2 inside each group, with a sigmoid router whose bias
    # moves by the load over every group, and the load-balancing loss
    ("hsdp=2,dp=2,ep=2", ("--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe-sigmoid", "--set",
                          "parallel.plan=llama_moe", "--set", "moe.bias_rate=0.01", "--set", "moe.load_balance=0.01")),
])
def test_fault_tolerant_groups_equal_plain_hsdp_with_other_dimensions(tmp_path, mesh, settings):
    assert_equal_to_plain_hsdp(tmp_path, mesh, *settings)


@pytest.mark.distributed
def test_parity_checks_fault_tolerant_groups_against_one_device_and_plain_hsdp(tmp_path):
    """--parity runs each replica group against the one-device reference (every group in
    every step: parity sets min_groups to hsdp), with the tolerances of docs/parity.md, and
    against the trajectory a plain hsdp=2,tp=2 parity run recorded: both groups PASS. The
    held-out loss after the last step is the mean over every group's rows, as one device's."""
    plain = tmp_path / "plain.json"
    evaluation = ("--set", "eval.every=5", "--set", "eval.steps=1", "--set", "data.holdout=0.2")
    recorded = launcher("--parity", "--mesh", "hsdp=2,tp=2", *evaluation, "--set", f"parity.record={plain}",
                        "--set", f"run.dir={tmp_path / 'plain'}", timeout=300)
    assert recorded.returncode == 0, recorded.stdout[-3000:]
    checked = launcher("--parity", "--mesh", "hsdp=2,tp=2", *FT, *evaluation, "--set",
                       f"parity.check_against={plain}", "--set", f"run.dir={tmp_path / 'ft'}", timeout=300)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    for group in (0, 1):
        report = json.loads((tmp_path / "ft" / f"group-{group}" / "parity.json").read_text())
        assert report["verdict"] == "PASS" and report["replica_group"] == f"{group} of 2", report["checks"]
        names = [check["name"] for check in report["checks"]]
        assert sum(name.startswith("replica groups missing") for name in names) == 5, names
        assert any(name.startswith("golden loss") for name in names), names
        assert "validation loss after 5 steps" in names, names


# A constant learning rate: a run of 2 steps and its continuation to 4 take the same updates
# as one run of 4 (the schedule's length is training.steps).
CONSTANT_LR = ("--set", "optim.warmup_steps=0", "--set", "optim.min_lr_ratio=1.0")
TWO_GROUPS = ("--mesh", "hsdp=2,dp=1", "--set", "training.global_batch=8", *CONSTANT_LR, "--set",
              "checkpoint.every=2")


def run_groups(run_dir, steps: int, *settings: str):
    result = launcher(*TWO_GROUPS, *FT, "--set", f"training.steps={steps}", "--set", f"run.dir={run_dir}",
                      *settings, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def figures(logged):
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in logged if r.get("committed", True)]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_whole_job_restart_resumes_every_group_from_the_checkpoint(tmp_path):
    """Fault-tolerant replica groups save checkpoints (the first live group writes them into
    run.dir/checkpoints; the first run's save is asynchronous) and a whole-job restart
    resumes from them: 2 steps, then the same command to 4, equals one run of 4 on every
    group, bit for bit, float32 (min_groups=2: both
    groups take every step). The checkpoint also reshards out of fault tolerance: a plain
    hsdp=2 job resumed from it takes the same gradients (grad norm and lr to the last bit,
    the loss within 4 float32 ulps, as in assert_equal_to_plain_hsdp)."""
    both = ("--set", "fault_tolerance.min_groups=2")
    run_groups(tmp_path / "whole", 4, *both)
    run_groups(tmp_path / "restarted", 2, *both, "--set", "checkpoint.async_save=true")
    run_groups(tmp_path / "restarted", 4, *both)
    expected = figures(records(tmp_path / "whole" / "group-0"))
    assert [r[0] for r in expected] == [0, 1, 2, 3]
    for group in (0, 1):
        assert figures(records(tmp_path / "whole" / f"group-{group}")) == expected
        assert figures(records(tmp_path / "restarted" / f"group-{group}")) == expected
    meta = json.loads((tmp_path / "restarted" / "checkpoints" / "step-00000004" / "meta.json").read_text())
    assert meta["fault_tolerance"]["positions"] == [4, 4] and meta["mesh"] == "hsdp=2", meta
    plain = launcher(*TWO_GROUPS, "--set", "training.steps=4", "--set", f"run.dir={tmp_path / 'plain'}",
                     "--resume", str(tmp_path / "restarted" / "checkpoints" / "step-00000002"), timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    resumed = figures(records(tmp_path / "plain"))
    assert [r[0] for r in resumed] == [2, 3]
    for (step, loss, norm, lr), (_, expected_loss, expected_norm, expected_lr) in zip(resumed, expected[2:]):
        assert (norm, lr) == (expected_norm, expected_lr), step
        assert math.isclose(loss, expected_loss, rel_tol=4 * 2**-23, abs_tol=0), (step, loss, expected_loss)


@pytest.mark.slow
@pytest.mark.distributed
def test_groups_resume_at_their_own_data_positions(tmp_path):
    """A checkpoint taken while group 1 was behind (its positions set here to what a run with
    group 1 down for a step records: step 2, group 0 at batch 2, group 1 at batch 1): each
    group resumes at its own batch and reads each of its batches once, group 1 alone for its
    last one. Only the same groups can resume it: a plain run, or 3 groups, are refused."""
    run_groups(tmp_path / "first", 2, "--set", "fault_tolerance.min_groups=2")
    saved = tmp_path / "first" / "checkpoints" / "step-00000002"
    meta = json.loads((saved / "meta.json").read_text())
    meta["fault_tolerance"]["positions"] = [2, 1]
    (saved / "meta.json").write_text(json.dumps(meta))
    for other in (["--mesh", "hsdp=2,dp=1"], ["--mesh", "hsdp=3,dp=1", *FT]):
        assert_refused([*TWO_GROUPS, *other, "--set", "training.steps=4", "--set", "training.global_batch=12",
                        "--resume", str(saved)], "only resumes as those 2 groups", "hsdp=2")
    run_groups(tmp_path / "first", 4)
    committed = {group: [r["step"] for r in records(tmp_path / "first" / f"group-{group}") if r["committed"]]
                 for group in (0, 1)}
    assert committed == {0: [0, 1, 2, 3], 1: [0, 1, 1, 2, 3]}, committed


@pytest.mark.distributed
@pytest.mark.slow
def test_a_killed_group_leaves_the_others_training_and_rejoins(tmp_path):
    """The survivors go on within SURVIVORS_BOUND_S (measured: docs/fault_tolerance.md), the
    killed group heals and rejoins, its weights then equal the survivors' at every common
    step, and each group's committed batches are each batch once."""
    figures = check_kill_and_rejoin(kill_and_rejoin(tmp_path / "run", steps=150), 150)
    assert figures["survivors_went_on_s"] < SURVIVORS_BOUND_S, figures


@pytest.mark.distributed
@pytest.mark.slow
def test_training_survives_a_lighthouse_restart(tmp_path):
    """The Lighthouse SIGKILLed mid-run: the supervisor starts it again on its port, the groups
    retry their quorum (fault_tolerance.quorum_retries, 20) and both train on together."""
    check_lighthouse_restart(kill_and_rejoin(tmp_path / "run", steps=60, victim=the_lighthouse), 60)


# The Lighthouse drops a silent group after 2 s (launch/replica_groups.py: HEARTBEAT_MS), and the
# survivors' failed step waits up to fault_tolerance.timeout_s (10 s) for the dead peer.
SURVIVORS_BOUND_S = 30


def test_goodput_at_meta_failure_rate():
    """engine/dryrun/goodput.py against the same arithmetic done by hand: 466 interruptions
    in 54 days on 16,384 GPUs is one every 54 x 86,400 / 466 = 10,012 s on a 16,384-GPU
    job; a whole-job restart loses 600 s + 1,800 / 2 s each, a replica group's failure
    (hsdp=16, 9.5 s steps) 9.5 + 2 + 600 / 16 s."""
    from common.config import Config
    from engine.dryrun.goodput import goodput
    value = goodput(16384, 16, 9.5, Config().dryrun)
    between = 54 * 86400 / 466
    assert math.isclose(value.restart, 1 / (1 + 1500 / between), rel_tol=1e-12)
    assert math.isclose(value.fault_tolerant, 1 / (1 + 49.0 / between), rel_tol=1e-12)
    assert math.isclose(value.failures_per_hour, 3600 / between, rel_tol=1e-12)
    assert goodput(16384, 1, 9.5, Config().dryrun).fault_tolerant is None
    # Every split of Meta's 128 data ranks into groups, the same arithmetic at the same step.
    splits = goodput(16384, 1, 9.5, Config().dryrun, data_ranks=128).splits
    assert [count for count, _, _ in splits] == [2, 4, 8, 16, 32, 64, 128]
    for count, share, lost in splits:
        assert math.isclose(lost, 9.5 + 2 + 600 / count, rel_tol=1e-12)
        assert math.isclose(share, 1 / (1 + lost / between), rel_tol=1e-12)
    assert splits[3][1] == value.fault_tolerant  # hsdp=16, as the layout with hsdp=16 gives it


def test_goodput_splits_the_data_ranks_by_powers_of_two_and_all_of_them():
    from engine.dryrun.goodput import group_counts
    assert group_counts(1) == []
    assert group_counts(2) == [2]
    assert group_counts(6) == [2, 6]
    assert group_counts(96) == [2, 4, 8, 16, 32, 96]
    assert group_counts(7) == [7]


@pytest.mark.distributed
def test_a_non_finite_loss_stops_every_group_without_restarts(tmp_path):
    """Every group sees the same loss, averaged over them, so each stops with exit 3; the
    supervisor passes the code on and restarts none (a restart would meet the same loss)."""
    result = launcher("--mesh", "hsdp=2,dp=1", *FT, "--set", "training.steps=4", "--set", "optim.lr=1.0e+30",
                      "--set", "optim.max_norm=0", "--set", "training.global_batch=8", "--set",
                      f"run.dir={tmp_path}", timeout=300)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "starting it again" not in result.stdout
    assert "stopping the others" in result.stdout
    assert "error: the loss is nan at step" in result.stderr
