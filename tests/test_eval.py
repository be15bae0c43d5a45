"""Evaluation (eval.every, eval.steps) through the launcher: real torchrun/gloo launches.
Its value against one device is checked by the combination matrix, whose rows with
`evaluation` compare the held-out loss of the mesh with the reference's
(tests/combinations.py)."""

import json
import math

import pytest

from tests.distributed import launcher
from tests.test_cli import assert_clean_error


@pytest.mark.distributed
def test_validation_loss_in_step_line_metrics_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = launcher("--mesh", "dp=2,tp=2", "--set", "training.steps=4", "--set", "eval.every=2",
                      "--set", "eval.steps=2", "--set", "data.holdout=0.2", "--set", "metrics.tensorboard=true",
                      "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert ["val loss" in line for line in lines] == [False, True, False, True], lines
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [1, 3]
    for record in evaluated:
        assert math.isfinite(record["val_loss"]) and record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]))
        assert f"val loss {record['val_loss']:.4f}" in lines[record["step"]]
    # The same held-out batches each time: training lowers their loss.
    assert evaluated[1]["val_loss"] < evaluated[0]["val_loss"]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val_loss")] == [1, 3]
    assert [e.step for e in events.Scalars("val_ppl")] == [1, 3]


def test_evaluation_without_held_out_data_is_refused():
    assert_clean_error(launcher("--mesh", "dp=2", "--set", "eval.every=2", timeout=60),
                       "eval.every", "data.holdout")
