"""Float8 training (parallel.float8, parallel/float8.py): what it refuses, that it computes
in float8 and still tracks bf16 training, and what the dry run makes of it (in the slow
tier, `make test-slow`: three dry runs, each a process with its fake process group).

The parity of float8 layouts is proven elsewhere, through real gloo runs: the combination
matrix's tensorwise (with float8 all-gathers where the mesh has no tp) and rowwise rows
(tests/combinations.py) and tensorwise under tp + SP (tests/test_parity.py, MATRIX). On the
CPU torchao emulates the float8 matmuls; tests/test_cuda.py runs them on a GPU."""

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from common.errors import UserError
from parallel.float8 import check_device, check_shapes, convert_to_float8, float8_linears
from tests.distributed import REPO, cpu_env
from tests.test_cli import assert_refused

# Float8 against bf16 on the same batches: the largest loss gap over the first steps of the
# debug model (0.016 tensorwise, 0.014 rowwise measured over these 8 steps, torch 2.13 CPU).
FLOAT8_LOSS_GAP = 0.05


@pytest.mark.parametrize("args,fragments", [
    (["--set", "parallel.float8=fp8"], ["accepted values: none, tensorwise, rowwise"]),
    (["--set", "parallel.float8_all_gather=true"], ["only parallel.float8=tensorwise", "it is none"]),
    (["--set", "parallel.float8=rowwise", "--set", "parallel.float8_all_gather=true"],
     ["only parallel.float8=tensorwise", "it is rowwise"]),
    (["--mesh", "dp=4", "--set", "parallel.float8=tensorwise", "--set", "parallel.float8_all_gather=true",
      "--set", "parallel.reshard_after_forward=2"], ["cannot run with parallel.reshard_after_forward=2",
                                                     "true or false"]),
    (["--dry-run", "--world", "8", "--set", "parallel.float8=rowwise", "--set", "dryrun.device=A100"],
     ["no float8 speed for dryrun.device=A100", "the A100 has no float8 matmuls"]),
    (["--parity", "--mesh", "dp=2,cp=2", "--set", "parallel.float8=tensorwise"],
     ["cannot check parallel.float8=tensorwise with cp=2", "parallel.float8=rowwise"]),
    (["--parity", "--mesh", "dp=2,tp=2", "--set", "parallel.float8=tensorwise", "--set",
      "parallel.float8_all_gather=true"], ["cannot check parallel.float8_all_gather=true with tp=2"]),
])
def test_bad_float8_settings_are_refused_before_any_process_group(args, fragments):
    assert_refused(args, *fragments)


def test_a_float8_run_without_torchao_exits_2_with_the_install_line(tmp_path):
    shadow = tmp_path / "torchao"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('torchao is not installed here')\n")
    env = {**cpu_env(), "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "launch/run.py", "--set", "parallel.float8=tensorwise"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "needs torchao" in result.stderr and "pip install torchao" in result.stderr, result.stderr


def test_widths_that_float8_matmuls_cannot_take_are_refused():
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 64, bias=False)))
    check_shapes(model, float8_linears(model, ["0"]), {}, 1)
    # Split over 2 tp ranks, the column style leaves each rank 24 output features.
    with pytest.raises(UserError, match=r"'0.0'.*each of tp=2 ranks holds 24 x 64.*multiples of 16"):
        check_shapes(model, ["0.0", "0.1"], {"0.0": ColwiseParallel(), "0.1": RowwiseParallel()}, 2)
    odd = nn.Sequential(nn.Sequential(nn.Linear(64, 40, bias=False)))
    with pytest.raises(UserError, match=r"64 x 40|40 x 64"):
        check_shapes(odd, float8_linears(odd, ["0"]), {}, 1)


def test_a_gpu_without_float8_matmuls_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"A100-SXM4-80GB is 8.0.*parallel.float8=none"):
        check_device("cuda")
    check_device("cpu")  # emulated there


def train_losses(recipe: str, steps: int = 8) -> list[float]:
    """The debug model's losses over `steps` AdamW steps in bf16, its blocks' linears in
    float8 unless `recipe` is none; the same initial values and batches every call."""
    from common.config import Config
    from launch.build import single_device_model
    from parallel.plan import expand, get_plan
    cfg = Config()
    model = single_device_model(cfg, torch.device("cpu"), 2, torch.bfloat16)
    if recipe != "none":
        paths = float8_linears(model, expand(model, get_plan("llama").blocks, "llama"))
        convert_to_float8(model, paths, recipe, all_gather=False, emulate=True)
        assert all(type(model.get_submodule(p)).__name__ == "Float8Linear" for p in paths) and len(paths) == 14
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # One batch, again and again: a model that learns memorises it, so the loss must fall.
    batch = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_training_computes_in_float8_and_tracks_bf16(recipe):
    bf16, float8 = train_losses("none"), train_losses(recipe)
    gaps = [abs(a - b) for a, b in zip(bf16, float8)]
    print(f"{recipe}: largest loss gap to bf16 {max(gaps):.4f}, losses {float8}")
    assert 0 < max(gaps) <= FLOAT8_LOSS_GAP, gaps  # different (float8 ran), and close
    assert float8[-1] < float8[0] - 0.5  # it learns


@pytest.mark.slow
@pytest.mark.distributed
def test_the_dry_run_counts_the_blocks_linears_at_the_float8_speed(tmp_path):
    """`launch/run.py --dry-run` (fake process group, one process per layout): the compute
    time falls by the float8 share of the FLOPs over the measured speedup, and float8
    all-gathers gather the blocks' weights in one byte each instead of bf16's two. (The
    peak is whatever the simulated torchao linears keep: at 8B:4:8192:1 the same as bf16's,
    as the H200 measured, which tests/test_docs_commands.py holds the documented
    predictions to.)"""
    import json

    from common.config import Config
    from engine.dryrun.estimate import FLOAT8_SPEEDUP
    from engine.metrics.throughput import flops_per_token
    from models import build_on_meta
    from tests.distributed import launcher

    def dry(name: str, *settings: str) -> dict:
        report = tmp_path / f"{name}.json"
        result = launcher("--dry-run", "--world", "4", "--mesh", "dp=4", "--set", "parallel.param_dtype=bfloat16",
                          *(item for setting in settings for item in ("--set", setting)),
                          "--set", f"dryrun.report={report}", timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(report.read_text())

    bf16 = dry("bf16")
    tensorwise = dry("tensorwise", "parallel.float8=tensorwise")
    gathered = dry("gathered", "parallel.float8=tensorwise", "parallel.float8_all_gather=true")
    block_weights = 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 768 * 256)  # wq, wo; wk, wv; w1, w2, w3
    total = flops_per_token(build_on_meta("llama", "debug"), Config().training.seq_len)
    float8_flops = 6 * block_weights
    expected = (total - float8_flops + float8_flops / FLOAT8_SPEEDUP["H100"]["tensorwise"]) / total
    assert tensorwise["step"]["compute_s"] / bf16["step"]["compute_s"] == pytest.approx(expected, rel=1e-9)

    def gathered_bytes(report: dict) -> int:
        return sum(kinds["all_gather"]["bytes"] for kinds in report["comm"]["dp"].values() if "all_gather" in kinds)
    # Forward and backward each gather every block weight: 2 bytes in bf16, 1 in float8.
    assert gathered_bytes(bf16) - gathered_bytes(gathered) >= 2 * block_weights
