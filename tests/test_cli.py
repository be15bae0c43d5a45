"""The launcher end to end: bad input exits 2 with one paragraph, good input trains.

Error cases never reach a process group, so they take a second each. The training
cases are real multi-process runs (torchrun, gloo, CPU).
"""

import json

import pytest

from tests.distributed import cpu_env, launcher


def assert_clean_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("args,fragments", [
    (["--mesh", "dp=4,pp=2"], ["unknown dimension 'pp'", "hsdp, dp, tp"]),
    (["--mesh", "dp=4,tp"], ["cannot read 'tp'"]),
    (["--mesh", "dp=0,tp=2"], ["dp=0 is not a valid size"]),
    (["--mesh", "dp=2,dp=2"], ["given twice"]),
    (["--mesh", "dp=-1,tp=-1", "--nproc", "8"], ["more than one dimension is -1"]),
    (["--mesh", "dp=-1,tp=2"], ["--nproc"]),
    (["--mesh", "dp=4,tp=2", "--nproc", "6"], ["needs 8 ranks", "world size is 6"]),
    (["--set", "training.stepz=3"], ["unknown config key 'training.stepz'", "steps"]),
    (["--set", "optim.lr=fast"], ["optim.lr must be of type float"]),
    (["--set", "model.flavor=huge"], ["no flavor 'huge'", "debug"]),
    (["--set", "parallel.plan=nope"], ["unknown plan 'nope'"]),
    (["--mesh", "dp=3", "--set", "training.global_batch=16"], ["does not divide over 3"]),
    (["--config", "missing.yaml"], ["does not exist"]),
    (["--mesh", "tp=8"], ["'layers.0.attention.wk'", "over tp=8 ranks"]),
    (["--set", "parallel.reshard_after_forward=3"], ["must divide the FSDP shard size dp=4"]),
    (["--set", "model.plugin=no_such_module"], ["model.plugin 'no_such_module' cannot be imported"]),
    (["--set", "model.name=gpt2", "--set", "parallel.plan=llama"], ["matches no module of GPT2"]),
    (["--parity", "--set", "parity.layers=9"], ["parity.layers=9 is deeper than llama/debug", "4 blocks"]),
    (["--parity", "--set", "parity.reference=false"], ["nothing to compare with", "parity.check_against"]),
    (["--parity", "--set", "parity.check_against=missing.json"], ["'missing.json' does not exist"]),
    (["--parity", "--set", "optim.name=lion"], ["accepted values: adamw, sgd"]),
])
def test_bad_input_without_torchrun(args, fragments):
    assert_clean_error(launcher(*args, timeout=60), *fragments)


def test_mesh_that_does_not_match_torchrun_world_size():
    # As torchrun would start a rank: the check runs before any process group exists.
    env = cpu_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", TORCHELASTIC_RUN_ID="test")
    assert_clean_error(launcher("--mesh", "dp=4,tp=2", env=env, timeout=60), "needs 8 ranks", "world size is 4")
    env["RANK"] = "1"  # other ranks exit with the same code and stay quiet
    result = launcher("--mesh", "dp=4,tp=2", env=env, timeout=60)
    assert result.returncode == 2 and result.stderr == ""


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_training_is_deterministic_and_learns(tmp_path):
    """Two runs with one seed print identical losses, and the loss falls."""
    runs = []
    for name in ("a", "b"):
        result = launcher("--mesh", "dp=2", "--set", "training.steps=8", "--set", f"run.dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "step 8/8" in result.stdout and "done: 8 steps" in result.stdout
        runs.append(losses(tmp_path / name))
    assert runs[0] == runs[1]
    assert runs[0][-1] < runs[0][0] - 1.0


@pytest.mark.distributed
def test_hsdp_with_tp_trains_on_eight_ranks(tmp_path):
    result = launcher("--mesh", "hsdp=2,dp=2,tp=2", "--set", "training.steps=4", "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh hsdp=2,dp=2,tp=2 on 8 ranks (cpu/gloo)" in result.stdout
    run = losses(tmp_path)
    assert len(run) == 4 and run[-1] < run[0]


@pytest.mark.distributed
def test_readme_command_with_integer_reshard_compile_and_explain(tmp_path):
    """The default dp=4,tp=2 run with reshard_after_forward=2 and torch.compile, plus --explain."""
    result = launcher("--mesh", "dp=4,tp=2", "--explain", "--set", "parallel.reshard_after_forward=2",
                      "--set", "parallel.compile=true", "--set", "training.steps=3",
                      "--set", f"run.dir={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout
    assert "layers.0.attention.wq" in table and "ColwiseParallel" in table
    block_row = next(line for line in table.splitlines() if line.startswith("layers.0 "))
    assert "unit" in block_row and " 2 " in block_row and "yes" in block_row
    assert "this rank holds" in table
    run = losses(tmp_path)
    assert len(run) == 3 and run[-1] < run[0]
