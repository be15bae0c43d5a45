"""The launcher end to end: bad input exits 2 with one paragraph, good input trains.

Every bad-input case runs through the launcher's own checks (launch/run.py: check) in
this process, which is where the command line stops before any process group; a few
also run through the real command line, to see the exit code and the one paragraph. The
training cases are real multi-process runs (torchrun, gloo, CPU).
"""

import json
from pathlib import Path

import pytest

from common.errors import UserError
from launch.run import check, parse_args
from tests.distributed import cpu_env, launcher


def refused(*args: str) -> str:
    """The paragraph the command line would print for these arguments, from its checks."""
    parsed = parse_args(list(args))
    with pytest.raises(UserError) as err:
        check(parsed, parsed.nproc)
    message = f"error: {err.value}"
    assert "\n\n" not in message, message
    return message


def assert_refused(args, *fragments) -> None:
    message = refused(*args)
    for fragment in fragments:
        assert fragment in message, message


def assert_clean_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


FILE, FOLDER = str(Path(__file__).resolve()), str(Path(__file__).resolve().parent)  # paths that exist

BAD_INPUT = [
    (["--mesh", "dp=4,ez=2"], ["unknown dimension 'ez'", "pp, hsdp, dp, cp, tp"]),
    (["--mesh", "dp=3,ep=2"], ["ep=2 borrows its ranks from dp, so it must divide dp=3"]),
    (["--mesh", "dp=2,ep=2"], ["plan 'llama' names none", "model.name=llama_moe"]),
    (["--mesh", "dp=6,ep=3", "--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe", "--set",
      "parallel.plan=llama_moe"], ["ep=3 must divide the number of experts, 8 in layers.0.feed_forward.experts"]),
    (["--mesh", "dp=4,ep=2", "--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe", "--set",
      "parallel.plan=llama_moe", "--set", "parallel.reshard_after_forward=2"], ["does not run with ep=2 yet"]),
    (["--mesh", "dp=2", "--set", "moe.load_balance=0.01"], ["this model has none", "model.name=llama_moe"]),
    (["--mesh", "dp=2", "--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe", "--set",
      "parallel.plan=llama_moe", "--set", "moe.bias_rate=0.001"], ["softmax ones", "model.flavor=debug-moe-sigmoid"]),
    (["--mesh", "dp=2", "--set", "moe.load_balance=-1"], ["moe.load_balance"]),
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
    # found by tests/test_config_fuzz.py: under pytest, importlib raised ValueError for "/"
    (["--set", "model.plugin=/"], ["model.plugin '/' is not a module name"]),
    (["--set", "model.name=gpt2", "--set", "parallel.plan=llama"], ["matches no module of GPT2"]),
    (["--parity", "--set", "parity.layers=9"], ["parity.layers=9 is deeper than llama/debug", "4 blocks"]),
    (["--parity", "--set", "parity.reference=false"], ["nothing to compare with", "parity.check_against"]),
    (["--parity", "--set", "parity.check_against=missing.json"], ["'missing.json' does not exist"]),
    (["--parity", "--set", "optim.name=lion"], ["accepted values: adamw, sgd"]),
    # What the run writes, checked before it starts: a folder where a file is asked for, and so on
    (["--set", f"run.dir={FILE}"], [f"run.dir {FILE!r} is a file; give a folder to write"]),
    (["--set", f"checkpoint.export={FOLDER}"], [f"checkpoint.export {FOLDER!r} is a folder; give a file"]),
    (["--set", f"checkpoint.export={FILE}/weights.pt"], [f"{FILE!r} is a file, so no folder can be made in it"]),
    (["--parity", "--set", f"parity.report={FOLDER}"], [f"parity.report {FOLDER!r} is a folder"]),
    (["--parity", "--set", f"parity.record={FILE}/r.json"], ["parity.record", "no folder can be made in it"]),
    (["--mesh", "cp=2", "--set", "training.seq_len=62"], ["does not split into 2 x cp = 4 equal chunks",
                                                          "multiple of 4"]),
    (["--mesh", "cp=2,tp=4", "--set", "parallel.sequence_parallel=true", "--set", "training.seq_len=12"],
     ["leaves each of cp=2 ranks 6 tokens", "tp=4"]),
    (["--mesh", "dp=2,cp=2", "--set", "parallel.reshard_after_forward=3"], ["FSDP shard size dp x cp = 4"]),
    (["--mesh", "cp=2", "--set", "model.plugin=examples.plain_model", "--set", "model.name=plain",
      "--set", "model.flavor=tiny", "--set", "parallel.plan=plain"], ["plan 'plain' names no attention core",
                                                                        "attention="]),
    (["--mesh", "cp=2", "--set", "model.plugin=tests.context_plans", "--set", "model.name=plain",
      "--set", "model.flavor=tiny", "--set", "parallel.plan=plain_attention"],
     ["PlainLM.forward takes no `positions`"]),
]


@pytest.mark.parametrize("args,fragments", BAD_INPUT)
def test_bad_input_is_refused_before_any_process_group(args, fragments):
    assert_refused(args, *fragments)


@pytest.mark.parametrize("kind", ["unknown dimension", "world size is", "unknown plan", "cannot be imported"])
def test_bad_input_on_the_command_line_exits_2_with_one_paragraph(kind):
    """One row of BAD_INPUT of each kind (a mesh, a world size, a plan, a plugin), found by
    its message so that rows added to the table do not shift it, run as a user runs it."""
    args, fragments = next(row for row in BAD_INPUT if kind in " ".join(row[1]))
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


def test_a_tests_subprocess_starts_outside_the_suites_make(monkeypatch):
    """`make test-docs ARGS="-k README"` once handed its ARGS (exported, and in MAKEFLAGS) to
    the documented `make run` it checks, which then passed pytest's options to the launcher."""
    import subprocess

    from tests.distributed import REPO
    monkeypatch.setenv("MAKEFLAGS", "s -- ARGS=-k\\ 'README'\\ --durations=8")
    monkeypatch.setenv("MAKELEVEL", "1")
    monkeypatch.setenv("ARGS", "-k 'README' --durations=8")
    shown = subprocess.run(["make", "-n", "run"], cwd=REPO, env=cpu_env(), capture_output=True, text=True, check=True)
    assert "launch/run.py" in shown.stdout and "README" not in shown.stdout, shown.stdout
