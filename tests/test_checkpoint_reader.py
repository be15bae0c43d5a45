"""A checkpoint folder is untrusted input (engine/checkpoint/reader.py): its `.metadata`
and its non-tensor items are read without running anything from them, and a folder
that cannot be read names the file and the cause.

The first tests use a one-process DCP checkpoint written here (no process group); the
last ones are the issue's scenario through `launch/run.py` on 2 ranks: a crafted
`.metadata` in the newest checkpoint, resumed with checkpoint.resume=auto (falls back,
runs nothing) and with --resume FOLDER (exit 2, runs nothing). Those and the check of a
real run's metadata against the allowed classes are in the compat subset: a torch that
stores another class in `.metadata` fails them by name.
"""

import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from engine.checkpoint import reader
from engine.checkpoint.reader import METADATA, Unreadable
from engine.checkpoint.store import step_name
from tests.distributed import launcher
from tests.test_cli import assert_clean_error, losses


class RunsCommand:
    """Pickles as a call of os.system: what a crafted file would hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture
def folder(tmp_path) -> Path:
    """A one-process DCP checkpoint with a tensor, a step and RNG-like bytes."""
    out = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.arange(6.0), "train": {"step": 3}, "rng": (b"state", b"")}, checkpoint_id=str(out))
    return out


def load_into(folder) -> dict:
    state = {"w": torch.zeros(6), "train": {"step": 0}, "rng": (b"", b"")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        reader.load(state, folder, None)
    return state


def test_a_checkpoint_reads_back_through_the_restricted_reader(folder):
    reader.check_readable(folder)
    state = load_into(folder)
    assert torch.equal(state["w"], torch.arange(6.0))
    assert state["train"]["step"] == 3 and state["rng"] == (b"state", b"")


def crafted(folder, payload: bytes) -> None:
    (folder / METADATA).write_bytes(payload)


def build_on_a_class() -> bytes:
    """STACK_GLOBAL Metadata, then BUILD with slot state: would set Metadata.__eq__ for the
    whole process."""
    module, name = Metadata.__module__, Metadata.__qualname__
    return (b"\x80\x04" + pickle.SHORT_BINUNICODE + bytes([len(module)]) + module.encode()
            + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name.encode() + pickle.STACK_GLOBAL
            + pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x06__eq__" + pickle.NONE
            + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)


@pytest.mark.parametrize("payload,cause", [
    (pickle.dumps(RunsCommand("touch {marker}")), "refused: it asks for posix.system"),
    (pickle.dumps(eval), "refused: it asks for builtins.eval"),
    (pickle.dumps(shutil.rmtree), "refused: it asks for shutil.rmtree"),
    (build_on_a_class(), "refused: it sets attributes of a type"),
    (b"\x80\x04\x8c\x01x" + pickle.BINPERSID + pickle.STOP, "persistent reference"),
    (pickle.dumps({"state_dict_metadata": {}}), "it holds a dict, not DCP metadata"),
    (b"\x80\x04\x95", "not a readable pickle"),
    (b"", "not a readable pickle"),
])
def test_crafted_metadata_is_refused_before_it_runs(folder, tmp_path, payload, cause):
    marker = tmp_path / "ran"
    crafted(folder, payload.replace(b"{marker}", str(marker).encode()))
    with pytest.raises(Unreadable) as err:
        reader.check_readable(folder)
    assert f"checkpoint {str(folder)!r} cannot be read: .metadata: " in str(err.value)
    assert cause in str(err.value)
    assert not marker.exists()
    assert Metadata.__eq__ is not None  # no class was changed on the way


def test_metadata_placing_data_outside_the_folder_is_refused(folder):
    metadata = reader.read_metadata(folder)
    for where in metadata.storage_data.values():
        where.relative_path = "../elsewhere.distcp"
    crafted(folder, pickle.dumps(metadata))
    with pytest.raises(Unreadable, match=r"places data in '../elsewhere.distcp', which is not a file of this"):
        reader.check_readable(folder)


def test_missing_and_truncated_data_files_are_named(folder):
    shard = next(folder.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:100])
    with pytest.raises(Unreadable, match=rf"{shard.name}: holds 100 bytes, but .metadata places data up to "
                                         rf"byte {len(data):,}: the file was cut short"):
        reader.check_readable(folder)
    shard.unlink()
    with pytest.raises(Unreadable, match=rf"{shard.name}: missing"):
        reader.check_readable(folder)


def test_an_item_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    out = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(6), "train": {"step": RunsCommand(f"touch {marker}")}, "rng": (b"", b"")},
                 checkpoint_id=str(out))
    assert not marker.exists()
    with pytest.raises(Unreadable, match=r"item 'train.step' is not a plain value \(it asks for posix.system\)"):
        load_into(out)
    assert not marker.exists()


def test_an_item_of_another_type_is_refused(tmp_path):
    out = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(6), "train": {"step": "three"}, "rng": (b"", b"")}, checkpoint_id=str(out))
    with pytest.raises(Unreadable, match="item 'train.step' holds a str where this run keeps a int"):
        load_into(out)


# -- through the command line, 2 ranks ---------------------------------------------------

RUN = ["--mesh", "dp=2", "--set", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """6 steps, a checkpoint every 2: the losses a resumed run must repeat."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = launcher(*RUN, "--set", f"run.dir={run_dir}", "--set", "training.steps=6")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.distributed
@pytest.mark.compat
def test_a_real_runs_metadata_reads_the_same_through_the_restricted_reader(uninterrupted):
    """On a torch that stores a new class in .metadata, the reader refuses it by name here."""
    for folder in sorted((uninterrupted / "checkpoints").glob("step-*")):
        reader.check_readable(folder)
        trusted = pickle.loads((folder / METADATA).read_bytes())  # this run wrote it: plain pickle is safe here
        assert reader.read_metadata(folder) == trusted


@pytest.mark.distributed
@pytest.mark.compat
def test_crafted_metadata_in_the_newest_checkpoint_runs_nothing(uninterrupted, tmp_path):
    """The issue's commands: train 4 steps with a checkpoint every 2, replace the newest
    checkpoint's .metadata with a pickle that runs a shell command, resume to 6 steps."""
    run_dir, marker = tmp_path / "run", tmp_path / "ran"
    first = launcher(*RUN, "--set", f"run.dir={run_dir}", "--set", "training.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    newest = run_dir / "checkpoints" / step_name(4)
    payload = pickle.dumps(RunsCommand(f"touch {marker}"))
    (newest / METADATA).write_bytes(payload)

    explicit = launcher(*RUN, "--set", f"run.dir={tmp_path / 'other'}", "--set", "training.steps=6",
                        "--resume", str(newest))
    assert_clean_error(explicit, f"checkpoint {str(newest)!r} cannot be read: .metadata: refused: it asks "
                                 f"for posix.system")
    assert not marker.exists()

    resumed = launcher(*RUN, "--set", f"run.dir={run_dir}", "--set", "training.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not marker.exists()
    warning = [line for line in resumed.stdout.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "asks for posix.system" in warning[0], resumed.stdout
    assert str(newest) in warning[0] and str(run_dir / "checkpoints" / step_name(2)) in warning[0]
    assert losses(run_dir)[4:] == losses(uninterrupted)[2:]  # steps 2..5 after the first run's 0..3
    kept = run_dir / "checkpoints" / (step_name(4) + ".unreadable")
    assert (kept / METADATA).read_bytes() == payload  # set aside as it was, not deleted
    assert json.loads((kept / "meta.json").read_text())["step"] == 4
    print(f"torch {torch.__version__}: --resume exit {explicit.returncode}: {explicit.stderr.strip()}\n"
          f"auto: exit {resumed.returncode}: {warning[0]}")


def test_a_problem_one_rank_sees_is_raised_on_every_rank(one_rank_group):
    from common.errors import raise_if_any_rank
    raise_if_any_rank(None, None)  # nobody has one: nothing happens
    with pytest.raises(Unreadable, match="rank 0 saw it"):
        raise_if_any_rank("rank 0 saw it", None, Unreadable)
