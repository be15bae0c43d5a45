"""Fault-tolerant replica groups (parallel/replicas.py, launch/replica_groups.py).

The refusals run through the launcher's checks in this process. The runs are real: a
torchft Lighthouse and one torchrun job per replica group, each FSDP over gloo, started by
`python launch/run.py` as a user starts them; the plain hsdp run they are compared with is
one torchrun job of the same mesh.
"""

from __future__ import annotations

import math
import socket
import sys

import pytest

from bench.fault_tolerance import check_kill_and_rejoin, kill_and_rejoin, records
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
    (["--mesh", "hsdp=2,dp=2", *FT, "--set", "checkpoint.every=5"], ["does not save or resume checkpoints yet"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe",
      "--set", "parallel.plan=llama_moe"], ["does not take a mixture of experts yet"]),
    (["--mesh", "hsdp=2,dp=2", *FT, "--parity"], ["does not combine with --parity"]),
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


@pytest.mark.distributed
@pytest.mark.compat
def test_fault_tolerant_groups_without_a_failure_equal_plain_hsdp(tmp_path):
    """hsdp=2,dp=2: two torchrun jobs of 2 ranks joined by torchft (min_groups=2, so both
    take every step) against one torchrun job of 4 ranks, float32. The gradient norm and the
    learning rate are equal to the last bit at every step, on both groups: the gradients the
    optimizer applies are the same. The logged loss is the float32 sum of the 4 data ranks'
    means, added in another order (two groups' sums, against gloo's over 4 ranks), so it may
    differ in its last bits: within 4 float32 ulps."""
    common = ("--mesh", "hsdp=2,dp=2", "--set", "training.steps=4")
    plain = launcher(*common, "--set", f"run.dir={tmp_path / 'plain'}", timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    ft = launcher(*common, *FT, "--set", "fault_tolerance.min_groups=2", "--set", f"run.dir={tmp_path / 'ft'}",
                  timeout=300)
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    expected = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records(tmp_path / "plain")]
    assert len(expected) == 4
    for group in (0, 1):
        logged = records(tmp_path / "ft" / f"group-{group}")
        assert all(r["committed"] and r["groups"] == 2 for r in logged), logged
        assert [(r["step"], r["grad_norm"], r["lr"]) for r in logged] == [(s, g, lr) for s, _, g, lr in expected]
        for record, (_, loss, _, _) in zip(logged, expected):
            assert math.isclose(record["loss"], loss, rel_tol=4 * 2**-23, abs_tol=0), (record["loss"], loss)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_killed_group_leaves_the_others_training_and_rejoins(tmp_path):
    """The survivors go on within SURVIVORS_BOUND_S (measured: docs/fault_tolerance.md), the
    killed group heals and rejoins, its weights then equal the survivors' at every common
    step, and each group's committed batches are each batch once."""
    figures = check_kill_and_rejoin(kill_and_rejoin(tmp_path / "run", steps=150), 150)
    assert figures["survivors_went_on_s"] < SURVIVORS_BOUND_S, figures


# The Lighthouse drops a silent group after 2 s (launch/replica_groups.py: HEARTBEAT_MS), and the
# survivors' failed step waits up to fault_tolerance.timeout_s (10 s) for the dead peer.
SURVIVORS_BOUND_S = 30
