"""What a run reports: FLOP counts and peaks, TensorBoard scalars, a stop on a non-finite
loss, and the config checks of the loop's keys. Runs are real launches on one rank."""

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.config import load_config
from common.errors import UserError
from engine.metrics.throughput import flops_per_token, peak_flops_for
from launch.run import DEFAULT_CONFIG
from models import build_on_meta
from tests.distributed import launcher
from tests.test_cli import assert_clean_error


def test_flops_per_token_counts_matmul_weights_and_attention():
    # debug: dim 256, 4 layers, 8 heads of 32 (4 kv heads), MLP 768, vocab 256.
    per_layer = 256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 768 + 2 * 256  # q, o; k, v; MLP; norms
    matmul_weights = 4 * per_layer + 256 + 256 * 256  # + final norm + output
    expected = 6 * matmul_weights + 12 * 4 * 256 * 64
    assert flops_per_token(build_on_meta("llama", "debug"), 64) == expected
    # Tied: the one shared matrix is the output projection, so the count is the same.
    assert flops_per_token(build_on_meta("llama", "debug_tied"), 64) == expected


def test_flops_estimate_without_args_and_the_models_own_count():
    """No args: 6 per matmul weight, the embedding (a lookup) left out. A model's own
    flops_per_token wins over the estimate."""
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.proj = torch.nn.Linear(4, 10)

    assert flops_per_token(Plain(), 64) == 6 * (4 * 10 + 10)

    class Counted(Plain):
        def flops_per_token(self, seq_len):
            return 7.0 * seq_len

    assert flops_per_token(Counted(), 64) == 7.0 * 64


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA H200", 989e12), ("NVIDIA GeForce RTX 3090", None), ("cpu", None),
])
def test_peak_table(name, peak):
    assert peak_flops_for(name) == peak


@pytest.mark.parametrize("override,fragment", [
    ("prefetch.forward=-1", "prefetch.forward must be a whole number at least 0 (0 keeps FSDP2's implicit "
                              "behaviour)"),
    ("training.micro_batches=0", "training.micro_batches must be a whole number above 0"),
    ("metrics.tensorboard=maybe", "metrics.tensorboard must be of type bool"),
])
def test_loop_keys_are_checked(override, fragment):
    with pytest.raises(UserError, match=None) as err:
        load_config(DEFAULT_CONFIG, [override])
    assert fragment in str(err.value)


def test_micro_batches_must_split_the_batch():
    result = launcher("--mesh", "dp=2", "--set", "training.global_batch=6", "--set", "training.micro_batches=2",
                      timeout=60)
    assert_clean_error(result, "training.micro_batches=2", "multiple of 4")


@pytest.mark.distributed
def test_tensorboard_holds_the_step_scalars(tmp_path):
    result = launcher("--mesh", "dp=1", "--set", "training.steps=3", "--set", "metrics.tensorboard=true",
                      "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"tensorboard --logdir {tmp_path / 'tensorboard'}" in result.stdout
    assert "GFLOP/s/rank" in result.stdout and "fwd+bwd" in result.stdout
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(str(events[0]))
    accumulator.Reload()
    for tag in ("loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_rank", "flops_per_s_per_rank",
                "data_s", "forward_backward_s", "optimizer_s", "memory_gib", "peak_memory_gib"):
        scalars = accumulator.Scalars(tag)
        assert [s.step for s in scalars] == [0, 1, 2], tag
        assert all(s.value > 0 for s in scalars), tag
    losses = [s.value for s in accumulator.Scalars("loss")]
    assert losses[-1] < losses[0]


@pytest.mark.distributed
def test_non_finite_loss_stops_the_run_with_the_step(tmp_path):
    # An absurd learning rate turns the parameters into infs after the first update.
    args = ["--mesh", "dp=1", "--set", "training.steps=4", "--set", "optim.lr=1.0e+30",
            "--set", "optim.max_norm=0", "--set", f"run.dir={tmp_path}"]
    result = launcher(*args)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stderr.count("error: ") == 1, result.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(records[0]["loss"]) and math.isnan(records[-1]["loss"])
    assert f"error: the loss is nan at step {len(records)} " in result.stderr
    assert "metrics.skip_nonfinite=true" in result.stderr
    skipped = launcher(*args, "--set", "metrics.skip_nonfinite=true")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert skipped.stdout.count("SKIPPED (non-finite loss)") == 4 - len(records) + 1
