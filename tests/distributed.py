"""Helpers for the multi-process tests: real torchrun launches over gloo on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun(nproc: int, script: str | Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(script), *args]
    return subprocess.run(command, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=timeout)


def launcher(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python launch/run.py ARGS`, which starts torchrun itself."""
    return subprocess.run([sys.executable, str(REPO / "launch" / "run.py"), *args], cwd=REPO,
                          env=env or cpu_env(), capture_output=True, text=True, timeout=timeout)


_REPORTS: dict[tuple, tuple[dict, dict]] = {}


def parity_report(tmp_root: Path, mesh: str, nproc: int, *overrides: str, flavor: str = "debug",
                  steps: int = 3) -> tuple[dict, dict]:
    """Run tests/parity_worker.py once per distinct case in this pytest session; returns
    (JSON report, step-0 full gradients by parameter name)."""
    import json

    import torch

    key = (mesh, nproc, flavor, steps, overrides)
    if key not in _REPORTS:
        out = tmp_root / f"parity-{len(_REPORTS)}.json"
        result = torchrun(nproc, REPO / "tests" / "parity_worker.py", mesh, str(out), str(steps),
                          flavor, *overrides, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        _REPORTS[key] = json.loads(out.read_text()), torch.load(str(out) + ".grads.pt")
    return _REPORTS[key]
