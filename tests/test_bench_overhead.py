"""bench/overhead.py and its hand-written baseline (bench/handwritten.py) still run, and
still compute what the engine computes: real gloo process groups, 2 ranks, 2 timed pairs
(the timings themselves are docs/benchmarks.md's, on a quiet machine). The two sides start
from the same weights on the same batch, so their step-0 losses must agree to fp32
rounding; for the mixture of experts (dp=2,ep=2) that checks the hand-written expert
parallel against the engine's."""

from __future__ import annotations

import re

import pytest

from tests.distributed import REPO, torchrun


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["dp=2", "dp=2,ep=2"])
def test_both_sides_of_the_overhead_benchmark_compute_the_same_loss(mesh):
    result = torchrun(2, REPO / "bench" / "overhead.py", mesh, "2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = re.search(r"engine (\d+\.\d+), handwritten (\d+\.\d+)", result.stdout)
    assert found, result.stdout
    engine, handwritten = (float(value) for value in found.groups())
    assert abs(engine - handwritten) <= 1e-5, result.stdout
    assert "ratio engine/handwritten per pair" in result.stdout
