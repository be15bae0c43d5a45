"""The divergence localizer, the tolerance rule and the trajectory file, in one process.

The localizer tests use a real one-rank gloo process group (the localizer reduces its
table over the world) and two whole debug models: the reference and a copy with a bug
planted in one module, in forward or in backward. The multi-rank case, a wrong plan
found through `launch/run.py --parity`, is in tests/test_parity.py.
"""

import json

import pytest
import torch

from engine.parity import trajectory
from engine.parity.compare import tolerance_for
from common.config import load_config
from engine.data.sources import CorpusSource, local_batch
from common.errors import UserError
from engine.parity.localize import RankPiece, expected_pieces, localize
from engine.parity.reference import Reference
from launch.build import single_device_model
from tests.distributed import REPO


def models_and_batch():
    cfg = load_config(None, ["training.global_batch=4", "training.seq_len=32"])
    reference = Reference(single_device_model(cfg, "cpu"), cfg)
    buggy = single_device_model(cfg, "cpu")
    batch = local_batch(CorpusSource(REPO / "data" / "corpus.txt", 0), 0, 4, 32)
    return reference, buggy, batch


class ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


def run(buggy, reference, batch):
    return localize(buggy, reference, *batch, *batch, RankPiece(), tolerance_for("float32", "adamw"), "cpu")


def test_a_forward_bug_is_named_by_its_output(one_rank_group):
    reference, buggy, batch = models_and_batch()
    buggy.get_submodule("layers.2.feed_forward.w3").register_forward_hook(lambda m, i, out: out * 1.001)
    first = run(buggy, reference, batch)["first"]
    assert (first["module"], first["what"]) == ("layers.2.feed_forward.w3", "output")


def test_a_backward_bug_is_named_by_its_input_gradient(one_rank_group):
    reference, buggy, batch = models_and_batch()
    buggy.get_submodule("layers.1.attention.wo").register_forward_pre_hook(
        lambda m, args: (ScaleGradient.apply(args[0]),))
    found = run(buggy, reference, batch)
    assert [f["what"] for f in found["differing"]][:1] == ["input gradient"]
    assert found["first"]["module"] == "layers.1.attention.wo"


def test_identical_models_show_no_divergence(one_rank_group):
    reference, same, batch = models_and_batch()
    found = run(same, reference, batch)
    assert found["first"] is None and found["values_compared"] > 2 * found["modules"]


def test_plain_pieces_are_matched_by_batch_rows_and_tp_slice():
    reference = torch.arange(4 * 6 * 8.0).reshape(4, 6, 8)
    where = RankPiece(data_rank=1, data_size=2, tp_rank=1, tp_size=2)
    rows = reference[2:4]
    assert torch.equal(expected_pieces(reference, rows, where)[0], rows)
    sequence_slice = rows[:, 3:, :]
    candidates = expected_pieces(reference, sequence_slice.clone(), where)
    assert any(torch.equal(c, sequence_slice) for c in candidates)
    assert expected_pieces(reference, torch.zeros(2, 5, 8), where) == []


def test_tolerance_rule():
    fp32, sgd, bf16 = tolerance_for("float32", "adamw"), tolerance_for("float32", "sgd"), tolerance_for("bfloat16", "adamw")
    assert (fp32.loss_at(0), fp32.loss_at(2), sgd.loss_at(2)) == (1e-5, 1e-4, 1e-5)
    assert fp32.grad_limit(3.0) == 1e-5 and bf16.grad_limit(0.5) == pytest.approx(4e-3)
    assert fp32.params_limit([1e-3, 2e-3], 0.1) == pytest.approx(6e-3)
    assert sgd.params_limit([1e-3, 2e-3], 0.1) < 1e-5


def test_trajectory_refuses_other_settings(tmp_path):
    cfg = load_config(None, [f"data.path={REPO / 'data' / 'corpus.txt'}"])
    path = tmp_path / "golden.json"
    trajectory.write(str(path), cfg, "dp=8", [1.0] * 5, [2.0] * 5, {"w": {"norm": 1.0, "head": [0.5]}})
    assert trajectory.read(str(path), cfg)["recorded_on"] == "dp=8"
    other = load_config(None, [f"data.path={REPO / 'data' / 'corpus.txt'}", "training.seed=7", "optim.lr=0.1"])
    with pytest.raises(UserError, match=r"seed: recorded 0, now 7.*optim"):
        trajectory.read(str(path), other)
    with pytest.raises(UserError, match="does not exist"):
        trajectory.read(str(tmp_path / "missing.json"), cfg)
    (tmp_path / "bad.json").write_text(json.dumps({"losses": []}))
    with pytest.raises(UserError, match="not a trajectory file"):
        trajectory.read(str(tmp_path / "bad.json"), cfg)
