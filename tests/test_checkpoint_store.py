"""The on-disk rules of checkpoints, without a process group: commit, latest, keep, resume choice."""

import pytest

from engine.checkpoint import store
from engine.checkpoint.reader import Unreadable
from common.config import CheckpointConfig
from common.errors import UserError


def fake_meta(step: int) -> dict:
    return {"step": step, "mesh": "dp=1", "world_size": 1, "data_size": 1, "state_dict": {},
            "config": {"model": {"name": "llama", "flavor": "debug"}}}


def fake_save(root, step, keep=2):
    """What every rank's DCP write leaves behind, then rank 0's commit."""
    partial = store.partial_folder(root, step)
    partial.mkdir(parents=True)
    (partial / store.DCP_METADATA).write_text("")
    return store.commit(partial, fake_meta(step), keep)


def folders(candidates: store.Candidates) -> list[str]:
    return [folder.name for folder in candidates.folders]


def test_commit_points_latest_and_keeps_the_newest(tmp_path):
    root = store.checkpoints_dir(tmp_path)
    for step in (2, 4, 6):
        fake_save(root, step)
    assert (root / store.LATEST).read_text() == store.step_name(6)
    assert sorted(p.name for p in root.iterdir()) == [store.LATEST, store.step_name(4), store.step_name(6)]
    assert store.read_meta(root / store.step_name(6)) == fake_meta(6)


def test_interrupted_save_never_replaces_latest(tmp_path):
    root = store.checkpoints_dir(tmp_path)
    fake_save(root, 2)
    store.partial_folder(root, 4).mkdir()  # a save killed before its commit
    assert folders(store.find_resume(CheckpointConfig(), tmp_path)) == [store.step_name(2)]
    fake_save(root, 6)  # the next commit clears what the crash left
    assert not store.partial_folder(root, 4).exists()


def test_a_replica_groups_commit_leaves_another_groups_save_in_progress(tmp_path):
    """Fault-tolerant replica groups take turns saving: group 1, leading while group 0 still
    writes step 4, commits step 6 and clears only its own leftovers."""
    root = store.checkpoints_dir(tmp_path)
    fake_save(root, 2)
    writing = store.partial_folder(root, 4, "group-0")
    writing.mkdir()
    store.partial_folder(root, 5, "group-1").mkdir()  # group 1's own, left by a crash
    partial = store.partial_folder(root, 6, "group-1")
    partial.mkdir()
    (partial / store.DCP_METADATA).write_text("")
    assert store.commit(partial, fake_meta(6), 2, "group-1") == root / store.step_name(6)
    assert writing.is_dir() and not store.partial_folder(root, 5, "group-1").exists()
    assert folders(store.find_resume(CheckpointConfig(), tmp_path)) == [store.step_name(6), store.step_name(2)]


def test_resume_modes(tmp_path):
    assert store.find_resume(CheckpointConfig(resume="auto"), tmp_path).folders == []
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
    chosen = store.find_resume(given, tmp_path / "run")
    assert chosen.folders == [source / store.step_name(3)] and not chosen.fallback  # named: it must read
    fake_save(store.checkpoints_dir(tmp_path / "run"), 5)
    chosen = store.find_resume(given, tmp_path / "run")
    assert chosen.folders == [store.checkpoints_dir(tmp_path / "run") / store.step_name(5)] and chosen.fallback


def test_key_check_lists_missing_unexpected_and_reshaped():
    with pytest.raises(UserError) as err:
        store.check_keys({"a": [2], "b": [3]}, {"a": [2, 2], "c": [1]}, "checkpoint X", "llama/debug")
    message = str(err.value)
    assert "missing keys: c" in message and "unexpected keys: b" in message
    assert "a [2] here vs [2, 2] in the model" in message


def test_the_run_falls_back_over_its_own_checkpoints_newest_first(tmp_path):
    root = store.checkpoints_dir(tmp_path)
    for step in (2, 4, 6):
        fake_save(root, step, keep=0)
    store.partial_folder(root, 8).mkdir()
    (root / (store.step_name(9) + store.UNREADABLE)).mkdir()  # set aside earlier: never a candidate
    chosen = store.find_resume(CheckpointConfig(), tmp_path)
    assert folders(chosen) == [store.step_name(6), store.step_name(4), store.step_name(2)] and chosen.fallback


@pytest.mark.parametrize("pointer", ["../../elsewhere", "/tmp", "step-00000002/..", "step-2", "", "latest"])
def test_latest_may_only_name_a_step_folder_inside_the_checkpoints_folder(tmp_path, pointer):
    root = store.checkpoints_dir(tmp_path)
    fake_save(root, 2)
    (root / store.LATEST).write_text(pointer)
    with pytest.raises(Unreadable, match="which is not a checkpoint folder of"):
        store.latest(root)
    chosen = store.find_resume(CheckpointConfig(), tmp_path)  # auto: the complete folders instead
    assert folders(chosen) == [store.step_name(2)] and "latest" in chosen.skipped[0][0]


def test_a_step_folder_that_links_out_of_the_run_is_not_followed(tmp_path):
    root = store.checkpoints_dir(tmp_path)
    fake_save(root, 2)
    elsewhere = fake_save(store.checkpoints_dir(tmp_path / "other"), 4)
    (root / store.step_name(4)).symlink_to(elsewhere)
    (root / store.LATEST).write_text(store.step_name(4))
    with pytest.raises(Unreadable, match="which is not a checkpoint folder of"):
        store.latest(root)
    assert folders(store.find_resume(CheckpointConfig(), tmp_path)) == [store.step_name(2)]


def test_set_aside_renames_damaged_folders_and_points_latest_at_the_one_resumed(tmp_path):
    root = store.checkpoints_dir(tmp_path)
    for step in (2, 4):
        fake_save(root, step)
    damaged = root / store.step_name(4)
    (damaged / "__0_0.distcp").write_bytes(b"kept as it was")
    kept = store.set_aside(root, [(str(damaged), "cut short")], root / store.step_name(2))
    assert kept == [store.step_name(4) + store.UNREADABLE]
    assert (root / kept[0] / "__0_0.distcp").read_bytes() == b"kept as it was"
    assert (root / store.LATEST).read_text() == store.step_name(2)
    fake_save(root, 4, keep=1)  # the step saved again, then pruned to one: the set-aside copy stays
    assert sorted(p.name for p in root.iterdir()) == [store.LATEST, store.step_name(4), kept[0]]
