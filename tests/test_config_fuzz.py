"""Hostile settings: every config key and --mesh get values a fuzzer would try.

The launcher's checks (launch/run.py: check, which runs before any process group) must
accept each value or refuse it with the engine's UserError: no other exception, so no
traceback, and nothing that starts a run which can only fail. A small sample also runs
through `launch/run.py` as a user types it: exit 0, or exit 2 with one `error:`
paragraph and no traceback.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from common.config import Config
from common.errors import UserError
from launch.run import check, parse_args
from tests.distributed import launcher

KEYS = sorted(f"{section.name}.{key.name}" for section in dataclasses.fields(Config)
              for key in dataclasses.fields(section.default_factory()))

# What people and fuzzers type: numbers past every limit, non-finite floats, YAML that is
# not a scalar, paths that are devices or escape, control characters, long text.
CLASSICS = ["nan", "-nan", "inf", "-inf", ".inf", "1e400", "-1e400", "1e-400", "-0", "0", "-1", "0.0",
            "9223372036854775807", "9223372036854775808", "-9223372036854775809", "18446744073709551616",
            "1e308", "3.0e-308", "0x10", "1_000", "", " ", "null", "~", "true", "no", "[]", "{}", "[1, 2]",
            "{a: 1}", "[[[[[[]]]]]]", "&a [*a]", "!!python/object/apply:os.system ['true']", "!!binary AAAA",
            "a\x00b", "\x00", "../../..", "/", ".", "/dev/zero", "/dev/null", "/proc/self/mem", "-", "dp=2",
            "x" * 5000, "é", "\u202e", "１２", "١", "'quoted'", "\"2\"", "2 # comment", "%", "*", "@", "`"]

VALUES = st.one_of(
    st.sampled_from(CLASSICS),
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=30),
)

MESHES = st.one_of(
    st.sampled_from(["", ",", "dp", "dp=", "=2", "dp=2,", "dp==2", "dp=2;tp=2", "dp=+2", "dp=1e3", "dp=0x2",
                     "dp=١", "dp=２", "DP=2", "dp = 2", "dp=-1,tp=-1", "dp=-2", "dp=99999999999999999999",
                     "hsdp=0", "tp=3", "dp=2,dp=2", "pp=2", "dp=2\x00", "dp=\u202e2"]),
    st.text(max_size=20),
    st.builds(lambda name, size: f"{name}={size}", st.sampled_from(["dp", "tp", "hsdp", "cp", "pp"]),
              st.integers(min_value=-(2**70), max_value=2**70)),
)

MODES = st.sampled_from([[], ["--parity"], ["--dry-run", "--world", "8"]])


def not_an_importable_module(value: str) -> bool:
    """model.plugin imports what it names, by design: the fuzzer gets names that import nothing."""
    try:
        return all(part and importlib.util.find_spec(part.split(".")[0]) is None
                   for part in value.split(",") if part.strip())
    except (ImportError, ValueError):
        return True


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "run"


def accepts_or_refuses(args: list[str]) -> None:
    parsed = parse_args(args)
    try:
        check(parsed, parsed.world if parsed.dry_run else parsed.nproc)
    except UserError as err:
        message = str(err)
        assert message and "\n\n" not in message and "Traceback" not in message, message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=VALUES, mode=MODES)
def test_every_key_takes_a_hostile_value_or_refuses_it(run_dir, key, value, mode):
    assume(key != "model.plugin" or not_an_importable_module(value))
    accepts_or_refuses(["--mesh", "dp=1", *mode, "--set", f"run.dir={run_dir}", "--set", f"{key}={value}"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mesh=MESHES, mode=MODES, nproc=st.sampled_from([[], ["--nproc", "2"], ["--nproc", "0"], ["--nproc", "-3"]]))
def test_every_mesh_string_is_taken_or_refused(run_dir, mesh, mode, nproc):
    # --mesh=VALUE, as a user passes a value that starts with "-" (argparse takes "--mesh -:" for two options)
    accepts_or_refuses([f"--mesh={mesh}", *mode, *([] if mode else nproc), "--set", f"run.dir={run_dir}"])


# The sample that runs: one step on one rank, each with one hostile setting. Settings the
# check accepts must train; sizes are kept small so that an accepted one finishes.
SIZES = {"training.steps", "training.global_batch", "training.seq_len", "training.micro_batches", "eval.steps",
         "eval.every", "parity.steps", "checkpoint.every", "optim.warmup_steps", "prefetch.forward",
         "prefetch.backward", "prefetch.unshard_ahead", "metrics.log_every", "checkpoint.keep",
         "parallel.checkpoint_every"}
NUMERIC = sorted({"optim.lr", "optim.weight_decay", "optim.beta1", "optim.beta2", "optim.eps", "optim.min_lr_ratio",
                  "optim.max_norm", "data.holdout", "training.seed", *SIZES})


@pytest.mark.distributed
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(NUMERIC), value=st.one_of(st.sampled_from(CLASSICS[:25]), VALUES))
def test_a_sample_of_hostile_settings_through_the_command_line(run_dir, key, value):
    assume("\x00" not in value)  # no command line can carry a NUL byte (the check refuses it: tested above)
    args = ["--mesh", "dp=1", "--set", "training.steps=1", "--set", f"run.dir={run_dir}-{abs(hash(value))}",
            "--set", f"{key}={value}"]
    parsed = parse_args(args)
    try:
        cfg, _ = check(parsed, None)
        accepted = True
    except UserError:
        accepted = False
    if accepted and key in SIZES:
        section, name = key.split(".")
        assume(getattr(getattr(cfg, section), name) <= 16)  # an accepted size runs; a large one would only take long
    result = launcher(*args, timeout=600)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    if accepted:
        assert result.returncode == 0, output[-3000:]
    else:
        message = result.stderr.strip()
        assert result.returncode == 2 and message.startswith("error: ") and "\n" not in message, output[-3000:]
    print(f"{key}={value[:40]!r}: exit {result.returncode}", file=sys.stderr)
