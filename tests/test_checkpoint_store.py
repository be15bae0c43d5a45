"""The on-disk rules of checkpoints, without a process group: commit, latest, keep, resume choice."""

import pytest

from engine.checkpoint.dcp import store
from engine.config import CheckpointConfig
from engine.errors import UserError


def fake_save(root, step, keep=2):
    """What every rank's DCP write leaves behind, then rank 0's commit."""
    partial = store.partial_folder(root, step)
    partial.mkdir(parents=True)
    (partial / store.DCP_METADATA).write_text("")
    return store.commit(partial, {"step": step}, keep)


def test_commit_points_latest_and_keeps_the_newest(tmp_path):
    root = store.checkpoints_dir(tmp_path)
    for step in (2, 4, 6):
        fake_save(root, step)
    assert (root / store.LATEST).read_text() == store.step_name(6)
    assert sorted(p.name for p in root.iterdir()) == [store.LATEST, store.step_name(4), store.step_name(6)]
    assert store.read_meta(root / store.step_name(6)) == {"step": 6}


def test_interrupted_save_never_replaces_latest(tmp_path):
    root = store.checkpoints_dir(tmp_path)
    fake_save(root, 2)
    store.partial_folder(root, 4).mkdir()  # a save killed before its commit
    assert store.find_resume(CheckpointConfig(), tmp_path) == root / store.step_name(2)
    fake_save(root, 6)  # the next commit clears what the crash left
    assert not store.partial_folder(root, 4).exists()


def test_resume_modes(tmp_path):
    assert store.find_resume(CheckpointConfig(resume="auto"), tmp_path) is None
    with pytest.raises(UserError, match="holds no complete checkpoint"):
        store.find_resume(CheckpointConfig(resume="always"), tmp_path)
    root = store.checkpoints_dir(tmp_path)
    fake_save(root, 2)
    with pytest.raises(UserError, match="resume=never"):
        store.find_resume(CheckpointConfig(resume="never"), tmp_path)
    (root / store.LATEST).unlink()
    with pytest.raises(UserError, match="no 'latest' pointer"):
        store.find_resume(CheckpointConfig(), tmp_path)


def test_run_folder_checkpoint_wins_over_resume_from(tmp_path):
    """A restarted job keeps its own progress instead of going back to where it began."""
    source = store.checkpoints_dir(tmp_path / "source")
    fake_save(source, 3)
    given = CheckpointConfig(resume_from=str(source / store.step_name(3)))
    assert store.find_resume(given, tmp_path / "run") == source / store.step_name(3)
    fake_save(store.checkpoints_dir(tmp_path / "run"), 5)
    assert store.find_resume(given, tmp_path / "run") == store.checkpoints_dir(tmp_path / "run") / store.step_name(5)


def test_key_check_lists_missing_unexpected_and_reshaped():
    with pytest.raises(UserError) as err:
        store.check_keys({"a": [2], "b": [3]}, {"a": [2, 2], "c": [1]}, "checkpoint X", "llama/debug")
    message = str(err.value)
    assert "missing keys: c" in message and "unexpected keys: b" in message
    assert "a [2] here vs [2, 2] in the model" in message
