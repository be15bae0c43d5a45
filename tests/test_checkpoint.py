"""Checkpoints end to end: resume, resharding, export/import, SIGKILL and restart, bad input.

One reference run (dp=2,tp=2, 6 steps, checkpoints at steps 3 and 6, final weights
exported) is shared by the tests. Tolerances: a resume on the same mesh must give
bitwise the same losses and checkpoint tensors; the first loss after loading on
another layout must be within 1e-5 (fp32 parity tolerance) of the reference's loss
at that step; the exported weights must equal the DCP ones bitwise.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from engine.checkpoint.store import COMPLETE, META, step_name
from common.config import load_config
from engine.data.sources import CorpusSource, local_batch
from engine.train import loss_fn
from models import build_on_meta
from tests.distributed import REPO, cpu_env, launcher, torchrun
from tests.test_cli import assert_clean_error, assert_refused, losses, refused

STEPS, EVERY, MESH = 6, 3, "dp=2,tp=2"


def run_args(run_dir, mesh=MESH, *extra):
    return ["--mesh", mesh, "--set", f"training.steps={STEPS}", "--set", f"checkpoint.every={EVERY}",
            "--set", f"run.dir={run_dir}", *extra]


def checkpoint(run_dir, step):
    return Path(run_dir) / "checkpoints" / step_name(step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    result = launcher(*run_args(run_dir, MESH, "--set", f"checkpoint.export={run_dir / 'final.pt'}"))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def full_checkpoint(folder, tmp_path) -> dict:
    """Everything a DCP checkpoint holds, as plain full tensors, read without a process group."""
    out = tmp_path / f"{Path(folder).parent.parent.name}-{Path(folder).name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def assert_bitwise_equal(ours, theirs, path="") -> None:
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs), path
        for key in theirs:
            assert_bitwise_equal(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), path
    else:
        assert ours == theirs, path


def plain_model(weights: dict) -> torch.nn.Module:
    model = build_on_meta("llama", "debug")
    model.to_empty(device="cpu")
    model.reset_buffers()
    model.load_state_dict(weights)
    return model


@pytest.mark.distributed
def test_full_disk_keeps_last_checkpoint_and_resume_is_bitwise(reference, tmp_path):
    """The save of step 6 fails on a full disk: step 3 stays latest. Resuming from it (with
    async saving) repeats steps 3..5 bitwise and writes the same step-6 checkpoint."""
    run_dir = tmp_path / "run"
    failed = torchrun(4, REPO / "tests" / "full_disk_worker.py", str(STEPS), *run_args(run_dir))
    assert failed.returncode != 0
    assert "error: saving the checkpoint of step 6" in failed.stderr, failed.stderr[-3000:]
    assert "No space left on device" in failed.stderr and "Traceback" not in failed.stdout
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == step_name(3)
    assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(3)]

    resumed = launcher(*run_args(run_dir, MESH, "--set", "checkpoint.async_save=true"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint(run_dir, 3)}" in resumed.stdout
    assert "data position = step 3" in resumed.stdout
    assert losses(run_dir)[STEPS:] == losses(reference)[EVERY:]
    saved = full_checkpoint(checkpoint(run_dir, 6), tmp_path)
    # The engine draws no random numbers while training, so the RNG states saved at step 6
    # are the ones restored from step 3 (each process starts from its own random seed).
    assert saved.pop("rng") == full_checkpoint(checkpoint(run_dir, 3), tmp_path)["rng"]
    expected = full_checkpoint(checkpoint(reference, 6), tmp_path)
    expected.pop("rng")
    assert_bitwise_equal(saved, expected)


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["dp=4", "tp=4", "hsdp=2,tp=2", "dp=1"])
def test_reshard_first_loss_matches(reference, tmp_path, mesh):
    result = launcher("--mesh", mesh, "--resume", str(checkpoint(reference, 3)), "--set", "training.steps=4",
                      "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"saved on mesh {MESH}" in result.stdout
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    expected = losses(reference)[3]
    print(f"{mesh}: first loss after loading {first['loss']!r}, reference {expected!r}, "
          f"diff {abs(first['loss'] - expected):.2e}")
    assert first["step"] == 3
    assert abs(first["loss"] - expected) <= 1e-5


def three_step_source(tmp_path_factory, mesh: str) -> Path:
    """A run of 3 steps on `mesh` with a checkpoint at step 2."""
    source = tmp_path_factory.mktemp("source")
    saved = launcher("--mesh", mesh, "--set", "training.steps=3", "--set", "checkpoint.every=2",
                     "--set", f"run.dir={source}")
    assert saved.returncode == 0, saved.stderr[-3000:]
    return source


def load_step_2(source: Path, source_mesh: str, mesh: str, run_dir: Path) -> str:
    """Resume `source`'s step-2 checkpoint on `mesh`: the first loss after loading must equal
    the source's own loss at that step within 1e-5. Returns the run's output."""
    loaded = launcher("--mesh", mesh, "--resume", str(checkpoint(source, 2)), "--set", "training.steps=3",
                      "--set", f"run.dir={run_dir}")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    ours, expected = losses(run_dir)[0], losses(source)[2]
    print(f"{source_mesh} -> {mesh}: first loss after loading {ours!r}, reference {expected!r}, "
          f"diff {abs(ours - expected):.2e}")
    assert abs(ours - expected) <= 1e-5
    return loaded.stdout


@pytest.fixture(scope="module")
def eight_rank_source(tmp_path_factory):
    """The issue's source layout: dp=4,tp=2 on 8 ranks."""
    return three_step_source(tmp_path_factory, "dp=4,tp=2")


@pytest.mark.distributed
@pytest.mark.parametrize("mesh,data_change", [("dp=2,tp=4", "4 -> 2"), ("dp=8", "4 -> 8"),
                                              ("hsdp=2,dp=2,tp=2", None), ("dp=1", "4 -> 1")])
def test_reshard_from_eight_ranks(eight_rank_source, tmp_path, mesh, data_change):
    """dp=4,tp=2 loaded at each of the issue's four targets."""
    output = load_step_2(eight_rank_source, "dp=4,tp=2", mesh, tmp_path)
    if data_change:
        assert f"data-parallel size {data_change}" in output


@pytest.fixture(scope="module")
def context_parallel_source(tmp_path_factory):
    """Context parallel at 2: each rank holds half of every sequence."""
    return three_step_source(tmp_path_factory, "cp=2")


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["cp=4", "dp=2"])
def test_reshard_between_context_parallel_degrees(context_parallel_source, tmp_path, mesh):
    """A cp=2 checkpoint loaded at cp=4 and without cp: parameters are sharded over dp x cp,
    so DCP maps them like any other shard."""
    load_step_2(context_parallel_source, "cp=2", mesh, tmp_path)


def test_long_context_flavors_load_the_short_flavors_checkpoints():
    """8B-128K, 70B-128K and 405B-128K hold the same tensors as 8B, 70B and 405B (only positions and rope
    scaling differ), so the short flavors' checkpoints and exports load into them."""
    from engine.checkpoint.store import state_dict_shapes
    for short, long in (("8B", "8B-128K"), ("70B", "70B-128K"), ("405B", "405B-128K"), ("8B", "8B-1M")):
        assert state_dict_shapes(build_on_meta("llama", short)) == state_dict_shapes(build_on_meta("llama", long))


def test_export_loads_into_plain_model(reference, tmp_path):
    exported = torch.load(reference / "final.pt", weights_only=True)
    from_dcp = full_checkpoint(checkpoint(reference, STEPS), tmp_path)["model"]
    assert_bitwise_equal(exported, from_dcp)
    inputs = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain_model(exported)(inputs), plain_model(from_dcp)(inputs))


@pytest.mark.distributed
def test_import_starts_parallel_run_from_exported_weights(reference, tmp_path):
    result = launcher("--mesh", "dp=2", "--set", f"checkpoint.init_from={reference / 'final.pt'}",
                      "--set", "training.steps=1", "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = load_config(REPO / "configs" / "debug.yaml")
    t = cfg.training
    inputs, targets = local_batch(CorpusSource(REPO / cfg.data.path, t.seed), 0, t.global_batch, t.seq_len)
    with torch.no_grad():
        expected = loss_fn(plain_model(torch.load(reference / "final.pt"))(inputs), targets).item()
    assert abs(losses(tmp_path)[0] - expected) <= 1e-5


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of local rank `rank` of the CPU run that `launcher` started: the children of
    its fork server (a child of the launcher that forks every rank, in rank order, and
    nothing else), which show the fork server's command line, so only their order tells
    them apart."""
    processes = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        processes[int(stat.parent.name)] = (int(fields[1]), int(fields[19]), command)  # parent, start, cmdline
    servers = {pid for pid, (parent, _, command) in processes.items()
               if parent == launcher and b"multiprocessing.forkserver" in command}
    ranks = sorted((start, pid) for pid, (parent, start, _) in processes.items() if parent in servers)
    return ranks[rank][1] if len(ranks) > rank else None


@pytest.mark.distributed
def test_sigkill_of_one_rank_restarts_and_finishes_identically(reference, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = [sys.executable, str(REPO / "launch" / "run.py"), "--max-restarts", "1",
               *run_args(run_dir, MESH, "--set", f"checkpoint.export={run_dir / 'final.pt'}")]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        job = subprocess.Popen(command, cwd=REPO, env=cpu_env(), stdout=out, stderr=err)
        killed = None
        deadline = time.monotonic() + 300
        while killed is None and job.poll() is None and time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and '"step": 4,' in metrics.read_text():
                killed = rank_pid(job.pid, 1)
                if killed:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        job.wait(timeout=300)
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert killed, "rank 1 was never found to kill"
    assert job.returncode == 0, stderr[-3000:]
    assert f"resumed from {checkpoint(run_dir, 3)}" in stdout
    assert_bitwise_equal(torch.load(run_dir / "final.pt"), torch.load(reference / "final.pt"))


def copy_checkpoint(reference, tmp_path, step=3) -> Path:
    return Path(shutil.copytree(checkpoint(reference, step), tmp_path / step_name(step)))


def test_missing_checkpoint_folder(tmp_path):
    assert_refused(["--resume", str(tmp_path / "nowhere")], "does not exist")


def test_incomplete_checkpoint_folder(reference, tmp_path):
    folder = copy_checkpoint(reference, tmp_path)
    (folder / COMPLETE).unlink()
    assert_refused([*run_args(tmp_path, MESH, "--resume", str(folder))],
                   "is not a complete checkpoint (no COMPLETE)")


def test_unreadable_checkpoint_metadata(reference, tmp_path):
    folder = copy_checkpoint(reference, tmp_path)
    (folder / META).write_text("{not json")
    assert_refused([*run_args(tmp_path, MESH, "--resume", str(folder))],
                   "unreadable meta.json")


def truncate_shard(folder: Path) -> str:
    shard = folder / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    return r"__1_0\.distcp: holds 1,000 bytes, but \.metadata places data up to byte [\d,]+: the file was cut short"


def remove_shard(folder: Path) -> str:
    (folder / "__2_0.distcp").unlink()
    return r"__2_0\.distcp: missing"


def garble_metadata(folder: Path) -> str:
    metadata = folder / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50] + b"\x00garbage")
    return r"\.metadata: not a readable pickle \(\w+Error: \S"


def empty_folder(folder: Path) -> str:
    for path in folder.iterdir():
        path.unlink()
    return r"is not a complete checkpoint \(no COMPLETE, meta\.json, \.metadata\)"


def zero_shard(folder: Path) -> str:
    """Same size, all zeros: only reading it shows the damage, so the ranks find it."""
    shard = folder / "__1_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    return r"__1_0\.distcp: \w+Error: \S"  # what torch says of it varies; the file is named


DAMAGE = [truncate_shard, remove_shard, garble_metadata, empty_folder]


def damaged_run(reference, tmp_path, damage) -> tuple[Path, str, bytes]:
    """A copy of the reference run folder whose newest checkpoint (step 6) is damaged;
    returns it, a pattern of the cause the error must name, and a fingerprint of what is left."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", run_dir / "checkpoints")
    newest = checkpoint(run_dir, STEPS)
    cause = damage(newest)
    return run_dir, cause, fingerprint(newest)


def fingerprint(folder: Path) -> bytes:
    return b"".join(p.name.encode() + p.read_bytes() for p in sorted(folder.iterdir()))


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda d: d.__name__)
def test_damaged_newest_checkpoint_is_passed_over_before_any_process_group(reference, tmp_path, damage):
    """resume=auto: the launcher's checks pick step 3 and say why step 6 was passed over;
    the same folder named with --resume exits 2, naming the file and the cause."""
    from launch.run import check, find_checkpoint, parse_args

    run_dir, cause, before = damaged_run(reference, tmp_path, damage)
    args = parse_args(run_args(run_dir, MESH, "--set", "training.steps=8"))
    cfg, spec = check(args, None)
    chosen = find_checkpoint(cfg, spec)
    assert chosen.folder == checkpoint(run_dir, 3)
    assert [path for path, _ in chosen.skipped] == [str(checkpoint(run_dir, STEPS))]
    assert re.search(cause, chosen.skipped[0][1]), chosen.skipped
    message = refused(*run_args(tmp_path / "other", MESH, "--resume", str(checkpoint(run_dir, STEPS))))
    assert re.search(cause, message) and str(checkpoint(run_dir, STEPS)) in message, message
    assert message.endswith("Resume from an earlier checkpoint with --resume FOLDER.")
    print(f"{damage.__name__}, --resume: exit 2: {message}")
    assert fingerprint(checkpoint(run_dir, STEPS)) == before  # nothing read or changed there


@pytest.mark.distributed
@pytest.mark.parametrize("damage", [truncate_shard, zero_shard], ids=lambda d: d.__name__)
def test_damaged_newest_checkpoint_falls_back_and_repeats_the_losses(reference, tmp_path, damage):
    """The run resumes from step 3 with one warning line naming both folders, repeats the
    reference's steps 3..5 bitwise, and keeps the damaged folder as step-6.unreadable. A
    truncated shard is found before any process group, a zeroed one by the ranks' read."""
    run_dir, cause, before = damaged_run(reference, tmp_path, damage)
    result = launcher(*run_args(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, result.stdout
    assert str(checkpoint(run_dir, STEPS)) in warnings[0] and str(checkpoint(run_dir, 3)) in warnings[0]
    assert re.search(cause, warnings[0]), warnings[0]
    assert f"resumed from {checkpoint(run_dir, 3)}" in result.stdout
    assert losses(run_dir) == losses(reference)[EVERY:]
    kept = checkpoint(run_dir, STEPS).with_name(step_name(STEPS) + ".unreadable")
    assert fingerprint(kept) == before
    print(f"{damage.__name__}: exit {result.returncode}: {warnings[0]}")


@pytest.mark.distributed
def test_named_checkpoint_that_the_ranks_cannot_read_exits_2(reference, tmp_path):
    folder = copy_checkpoint(reference, tmp_path)
    cause = zero_shard(folder)
    result = launcher(*run_args(tmp_path / "run", "dp=1", "--resume", str(folder)))
    # Found by the rank, not the launcher: the launcher prints the rank's paragraph once.
    assert_clean_error(result, f"checkpoint '{folder}' cannot be read: ", "Resume from an earlier")
    assert re.search(cause, result.stderr), result.stderr


def test_checkpoint_of_another_flavor(reference, tmp_path):
    assert_refused([*run_args(tmp_path, MESH, "--resume", str(checkpoint(reference, 3)),
                                  "--set", "model.flavor=1B")],
                   "does not fit model llama/1B", "different shapes", "tok_embeddings.weight")


def test_checkpoint_with_other_parameter_names(reference, tmp_path):
    folder = copy_checkpoint(reference, tmp_path)
    meta = json.loads((folder / META).read_text())
    meta["state_dict"]["extra.weight"] = meta["state_dict"].pop("norm.weight")
    (folder / META).write_text(json.dumps(meta))
    assert_refused([*run_args(tmp_path, MESH, "--resume", str(folder))],
                   "missing keys: norm.weight", "unexpected keys: extra.weight")


def test_config_change_that_cannot_resume(reference, tmp_path):
    assert_refused([*run_args(tmp_path, MESH, "--resume", str(checkpoint(reference, 3)),
                                  "--set", "training.global_batch=8")],
                   "training.global_batch was 16, now 8", "the mesh, training.steps")


def test_resume_without_checkpoint(tmp_path):
    assert_refused([*run_args(tmp_path, MESH, "--resume")], "holds no complete checkpoint")


def test_never_resume_over_existing_checkpoints(reference):
    assert_refused([*run_args(reference, MESH, "--set", "checkpoint.resume=never")],
                   "checkpoint.resume=never but")


def test_missing_import_file(tmp_path):
    assert_refused(["--set", f"checkpoint.init_from={tmp_path / 'no.pt'}"],
                   "checkpoint.init_from", "does not exist")


def test_an_import_file_that_torch_did_not_write_is_refused_before_any_rank_starts(tmp_path):
    text = tmp_path / "notes.pt"
    text.write_text("not a state dict\n")
    assert_refused(["--set", f"checkpoint.init_from={text}"], "is not a file written by torch.save")
