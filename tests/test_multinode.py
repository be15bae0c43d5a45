"""Several nodes, simulated on this machine: two torchrun agents (c10d rendezvous on
127.0.0.1, 4 ranks each, gloo), as docs/multinode.md starts them on two hosts."""

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from tests.distributed import REPO, cpu_env, free_port, launcher
from tests.test_checkpoint import assert_bitwise_equal
from tests.test_cli import losses

MESH = "hsdp=2,dp=2,tp=2"


def start_nodes(tmp_path, script, *args, max_restarts: int = 0) -> list[subprocess.Popen]:
    """Two agents of one job; each writes node<N>.out and node<N>.err under tmp_path."""
    port, nodes = free_port(), []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "4",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tmp_path.name,
                   f"--max-restarts={max_restarts}", str(script), *args]
        nodes.append(subprocess.Popen(command, cwd=REPO, env=cpu_env(),
                                      stdout=open(tmp_path / f"node{node}.out", "w"),
                                      stderr=open(tmp_path / f"node{node}.err", "w")))
    return nodes


def finish(nodes, timeout=400) -> list[int]:
    return [node.wait(timeout=timeout) for node in nodes]


def output(tmp_path) -> str:
    return "".join((tmp_path / f"node{n}.out").read_text() for n in range(2))


def errors(tmp_path) -> str:
    return "".join((tmp_path / f"node{n}.err").read_text()[-3000:] for n in range(2))


RUN = REPO / "launch" / "run.py"


ARGS = ["--mesh", MESH, "--set", "parallel.reshard_after_forward=auto", "--set", "training.steps=6",
        "--set", "checkpoint.every=3"]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The same job on one node, uninterrupted: the reference for both tests below."""
    run_dir = tmp_path_factory.mktemp("one-node")
    result = launcher(*ARGS, "--set", f"run.dir={run_dir}", "--set", f"checkpoint.export={run_dir / 'final.pt'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_read_the_node_size_and_match_one_node(tmp_path, one_node):
    codes = finish(start_nodes(tmp_path, RUN, *ARGS, "--set", f"run.dir={tmp_path / 'two'}"))
    assert codes == [0, 0], errors(tmp_path)
    assert "reshard_after_forward=auto: 4 ranks per node (LOCAL_WORLD_SIZE), tp=2, dp=2 -> True" in output(tmp_path)
    run_dir, stdout = one_node
    assert "reshard_after_forward=auto: 8 ranks per node (LOCAL_WORLD_SIZE), tp=2, dp=2 -> True" in stdout
    two, one = losses(tmp_path / "two"), losses(run_dir)
    assert len(two) == 6 and two == one  # the same collectives on the same ranks: bitwise


@pytest.mark.distributed
@pytest.mark.compat
@pytest.mark.slow
def test_restart_after_one_node_lost_a_rank_with_different_restart_counts(tmp_path):
    nodes = start_nodes(tmp_path, REPO / "tests" / "restart_round_worker.py", str(tmp_path / "left"),
                        max_restarts=1)
    assert finish(nodes) == [0, 0], errors(tmp_path)
    # Ranks share each node's output file, so lines may interleave: read records, not lines.
    records = re.findall(r"rank (\d+) restart count (\d+) sum (\d+)", output(tmp_path))
    assert sorted(int(rank) for rank, _, _ in records) == list(range(8))
    assert {total for _, _, total in records} == {"28"}  # 0 + 1 + ... + 7, across both nodes
    counts = {count for _, count, _ in records}
    assert counts == {"0", "1"}, counts  # the agents disagree on the count, the ranks still meet


@contextmanager
def cpu_load(seconds: float):
    """Two busy processes per core, for at most `seconds`: the restart below runs on a
    machine as busy as a shared CI runner."""
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


@pytest.mark.distributed
@pytest.mark.slow
def test_rank_killed_on_one_node_under_cpu_load_resumes_both_with_the_uninterrupted_losses(tmp_path, one_node):
    """Rank 5 (the second node) is SIGKILLed right after step 4 of 6, checkpoints every 3
    steps, --max-restarts 1, while the test keeps every core busy: both nodes resume from
    step 3, every logged loss equals the uninterrupted one-node run's at that step, and
    the exported final weights equal its weights bitwise."""
    run_dir, killed = tmp_path / "run", tmp_path / "killed"
    with cpu_load(seconds=600):
        nodes = start_nodes(tmp_path, REPO / "tests" / "killed_rank_worker.py", "5", "4", str(killed), *ARGS,
                            "--set", f"run.dir={run_dir}", "--set", f"checkpoint.export={tmp_path / 'final.pt'}",
                            max_restarts=1)
        codes = finish(nodes, timeout=600)
    assert killed.exists(), "rank 5 was never killed"
    assert codes == [0, 0], errors(tmp_path)
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000003'}" in output(tmp_path)
    reference_dir, _ = one_node
    assert_bitwise_equal(torch.load(tmp_path / "final.pt"), torch.load(reference_dir / "final.pt"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-3:] == [3, 4, 5]
    assert [r["loss"] for r in records] == [losses(reference_dir)[r["step"]] for r in records]
