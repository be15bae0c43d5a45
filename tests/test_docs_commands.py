"""Every command that README.md and docs/*.md show in a ```sh block runs here exactly
as typed, block by block in document order, in a scratch copy of the checkout (its
tracked files, with .venv linked in and first on PATH, as after
`source .venv/bin/activate`; OMP_NUM_THREADS=1, no GPU). Each must exit 0; some must
also print what the document says they print (EXPECTED).

A block is left out only when the line before it says so, in an HTML comment that
starts with "not run by the suite:" and gives the reason. Those are the suite's own
commands (`make test`, `make test-compat`, which .ci/run runs), the commands that
regenerate a document's figures (minutes of benchmark), and command lines for several
hosts (tests/test_multinode.py runs them with 127.0.0.1). test_left_out_blocks_say_why
keeps that list honest.

These runs take minutes, so they are not part of `make test`: `make test-docs` runs
them, and .ci/run those its CI_DOCS_FIRST and CI_DOCS_SECOND name.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.distributed import REPO, cpu_env

pytestmark = pytest.mark.docs

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LEFT_OUT = "<!-- not run by the suite:"
BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)

# command fragment -> what its output must show
EXPECTED = {
    "--explain": ["this rank holds"],
    "--explain --set parallel.reshard_after_forward=2": ["layers.0.attention.wq", "ColwiseParallel"],
    "--parity": ["PASS:"],
    "parity.check_against=golden.json": ["checked against the trajectory in golden.json"],
    "--mesh hsdp=2,dp=2,tp=2 --set training.steps": ["mesh hsdp=2,dp=2,tp=2 on 8 ranks (cpu/gloo)"],
    "model.name=gpt2": ["plan gpt2"],
    "--dry-run --world 1024": ["1024 simulated ranks", "memory per rank, GiB", "tokens/s, MFU"],
    "bench/dryrun_validation.py": ["(equal)"],
    "--plan-for --world 64": ["searched", "python launch/run.py --set model.flavor=8B"],
    "bench/init_time.py": ["| 8 | 12,585,312 |"],
    "bench/context_memory.py": ["| cp=4 | 4 | 8,192 | 2,048 |"],
    "bench/saved_activations.py": ["| true |", "count 4,980,736 bytes per block"],
    "prepare.py --check": ["every id inside the --vocab-size vocabulary of 256"],
    "--trace runs/trace.json": ["pp rank  stages", "trace -> runs/trace.json"],
    # docs/planning.md, "Float8, calibrated on an H200": 184.0, 166.6 and 178.6 ms, 45.2 GiB
    "--one engine+keep --shape": ['"peak_bytes": 48495485096, "step_s": 0.18402'],
    "--one engine+float8-tensorwise+keep": ['"peak_bytes": 48495485096, "step_s": 0.16664'],
    "--one engine+float8-rowwise+keep": ['"peak_bytes": 48495485096, "step_s": 0.17856'],
    "--parity --mesh dp=2,tp=2 --set parallel.float8=rowwise": ["PASS:", "bfloat16 + float8 rowwise"],
    "--mesh pp=16,dp=128,tp=8 --set model.flavor=405B --set parallel.param_dtype=bfloat16": [
        "step 9.525 s", "whole-job restart from the last checkpoint: 87.0% (1500 s", "hsdp=2: 97.0% (311.5 s",
        "hsdp=16: 99.5% (49.0 s", "hsdp=128: 99.8% (16.2 s"],
    "fault_tolerance.enabled=true --set training.steps": ["[replica groups] group 0 finished",
                                                          "[replica groups] group 1 finished"],
}


def blocks() -> list[tuple[str, int, list[str], str | None]]:
    """(document, block number, commands, reason it is left out or None)."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for number, match in enumerate(BLOCK.finditer(text)):
            before = text[:match.start()].rstrip().splitlines()
            reason = before[-1] if before and before[-1].startswith(LEFT_OUT) else None
            joined = match.group(1).replace("\\\n", " ")
            commands = [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
            found.append((str(document.relative_to(REPO)), number, commands, reason))
    return found


RUN = [(f"{doc}:{number}", commands) for doc, number, commands, reason in blocks() if reason is None]


def test_left_out_blocks_say_why():
    left_out = [(doc, commands, reason) for doc, _, commands, reason in blocks() if reason is not None]
    for doc, commands, reason in left_out:
        assert len(reason) > len(LEFT_OUT) + 10, (doc, commands)
    # A handful: the suite's own commands, figures and searches of minutes, several hosts, GPUs.
    assert len(left_out) <= 10, left_out
    assert len(RUN) >= 10


@pytest.fixture(scope="session")
def scratch(tmp_path_factory) -> Path:
    """The tracked files, as a fresh clone has them, with the suite's .venv."""
    root = tmp_path_factory.mktemp("checkout")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, tracked.stdout.split("\0")):
        if (REPO / name).exists():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    (root / ".venv").symlink_to(REPO / ".venv")
    return root


@pytest.mark.distributed
@pytest.mark.parametrize("where,commands", RUN, ids=[where for where, _ in RUN])
def test_documented_command_runs_as_typed(scratch, where, commands):
    env = cpu_env(PATH=f"{scratch / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for command in commands:
        result = subprocess.run(command, shell=True, cwd=scratch, env=env, capture_output=True, text=True,
                                timeout=900, executable="/bin/bash")
        assert result.returncode == 0, f"{where}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, f"{where}: {command}\n{result.stderr[-3000:]}"
        for fragment, shown in EXPECTED.items():
            if fragment in command:
                for text in shown:
                    assert text in result.stdout, f"{where}: {command}: no {text!r} in\n{result.stdout[-3000:]}"
