"""Parity seed: the sharded debug model against a single-process reference (fp32).

Each case is a real torchrun launch over gloo (tests/parity_worker.py). Tolerances:
step-0 loss and every full gradient within 1e-5 absolute; the initial weights must be
bitwise equal (the init is layout independent by construction); the grad norm within
1e-5 relative; later losses within 1e-4, since AdamW amplifies reduction-order noise.
"""

import json
import math

import pytest

from tests.distributed import REPO, torchrun

CASES = [("dp=2,tp=2", 4, "debug"), ("dp=4", 4, "debug"), ("dp=2,tp=2", 4, "debug_tied"),
         ("hsdp=2,dp=2,tp=2", 8, "debug")]


@pytest.mark.distributed
@pytest.mark.parametrize("mesh,nproc,flavor", CASES)
def test_matches_single_process_reference(tmp_path, mesh, nproc, flavor):
    out = tmp_path / "report.json"
    result = torchrun(nproc, REPO / "tests" / "parity_worker.py", mesh, str(out), "3", flavor)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["init_max_diff"] == 0.0
    assert report["loss0_diff"] <= 1e-5
    assert report["grad_max_diff"] <= 1e-5, report["worst_grad"]
    for norm_type in ("2.0", "inf"):
        ours, reference = report[f"grad_norm_{norm_type}"]
        assert math.isclose(ours, reference, rel_tol=1e-5), (norm_type, ours, reference)
    for ours, reference in zip(report["losses"], report["ref_losses"]):
        assert abs(ours - reference) <= 1e-4
