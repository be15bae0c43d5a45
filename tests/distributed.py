"""Helpers for the multi-process tests: real torchrun launches over gloo on the CPU."""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# A rank's identity, and what a `make` that started pytest hands to any make below it.
NOT_INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                 "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def make_command_line_variables() -> set[str]:
    """The variables given on the command line of the `make` that started pytest (`make
    test-docs ARGS=...`): make exports them, and a documented `make run` would take that ARGS
    as its own. MAKEFLAGS lists them after " -- ", separated by unescaped spaces."""
    _, _, overrides = os.environ.get("MAKEFLAGS", "").partition(" -- ")
    return set(re.findall(r"(?:^|(?<!\\) )([A-Za-z_][A-Za-z0-9_]*)=", overrides))


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment a subprocess of a test starts in: the user's shell's, not the suite's."""
    dropped = set(NOT_INHERITED) | make_command_line_variables()
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def free_port() -> int:
    """A port for a torchrun of the user's own kind (static rendezvous): its default, 29500,
    may be held by another job on this machine (a second suite, the user's own run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str | Path, *args: str, timeout: float = 300,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A worker script on `nproc` ranks under torchrun's agent, started as a CPU run's ranks
    are, by a fork server (tests/forked_torchrun.py). Tests of the user's own torchrun call
    it directly. `env`: variables to add."""
    command = [sys.executable, str(REPO / "tests" / "forked_torchrun.py"), str(nproc), str(script), *args]
    return subprocess.run(command, cwd=REPO, env=cpu_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def call_in_own_process(function: str, *args) -> object:
    """`function` ("tests.module:name") called with `args` (reprs of plain values) in a
    Python process of its own, as a test that starts a process group (one of torch's fake
    ones) without touching the suite's; returns what it returned, through JSON."""
    module, name = function.split(":")
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); from {module} import {name}; "
            f"print(json.dumps({name}({', '.join(map(repr, args))})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def launcher(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python launch/run.py ARGS`, which starts torchrun itself: run by a process that has
    imported torch and the engine already and forks one child per launch
    (tests/launch_server.py), one such process per thread that asks."""
    import json
    import tempfile

    server = getattr(_SERVERS, "server", None)
    if server is None or server.poll() is not None:
        server = _SERVERS.server = subprocess.Popen([sys.executable, str(REPO / "tests" / "launch_server.py")],
                                                    cwd=REPO, env=cpu_env(), stdin=subprocess.PIPE,
                                                    stdout=subprocess.PIPE, text=True)
    command = [sys.executable, str(REPO / "launch" / "run.py"), *args]
    with tempfile.TemporaryDirectory() as scratch:
        out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
        server.stdin.write(json.dumps({"argv": list(args), "env": env or cpu_env(), "cwd": str(REPO),
                                       "stdout": str(out), "stderr": str(err), "timeout": timeout}) + "\n")
        server.stdin.flush()
        answer = json.loads(server.stdout.readline())
        stdout, stderr = (path.read_text(errors="replace") if path.exists() else "" for path in (out, err))
    if answer.get("timed_out"):
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, answer["code"], stdout, stderr)


_SERVERS = threading.local()


# A line of torch's own logging, e.g. "[rank0]:W1123 18:24:50.607000 6708 .../codecache.py:662] ...".
TORCH_LOG_LINE = re.compile(r"^(\[rank\d+\]:)?[DIWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")


def own_output(text: str) -> str:
    """`text` without torch's logged warnings. torch 2.12 logs one, with a traceback, when
    inductor cannot pickle a flattened DeviceMesh for its cache key (pytorch/pytorch#179597):
    compilation goes on without that cache, the numbers are unaffected."""
    return "\n".join(line for line in text.splitlines() if not TORCH_LOG_LINE.match(line))


_REPORTS: dict[tuple, tuple[dict, int]] = {}
_RUNS = itertools.count()  # numbers the report files of this session


def parity_arguments(tmp_root: Path, out: Path, mesh: str, overrides: tuple, steps: int) -> list[str]:
    return ["--parity", "--mesh", mesh, "--set", f"parity.steps={steps}", "--set", f"parity.report={out}",
            "--set", f"run.dir={tmp_root}", *[arg for o in overrides for arg in ("--set", o)]]


def parity_report(tmp_root: Path, mesh: str, *overrides: str, steps: int = 3) -> tuple[dict, int]:
    """`launch/run.py --parity` once per distinct case in this pytest session; returns
    (the JSON report, the exit code). A case that `run_together` ran already is read
    from there."""
    import json

    key = (mesh, steps, overrides)
    if key not in _REPORTS:
        out = tmp_root / f"parity-{next(_RUNS)}.json"
        result = launcher(*parity_arguments(tmp_root, out, mesh, overrides, steps), timeout=600)
        assert out.exists(), result.stdout[-3000:] + result.stderr[-4000:]
        assert "Traceback" not in own_output(result.stderr), result.stderr[-4000:]  # a verdict, never a crash
        _REPORTS[key] = json.loads(out.read_text()), result.returncode
    return _REPORTS[key]


def run_together(tmp_root: Path, cases: list[tuple[str, tuple, int]], env: dict[str, str] | None = None,
                 reports: dict | None = None) -> list[str]:
    """Run the parity cases (mesh, overrides, steps) not run yet, one torchrun job per
    world size (tests/shared_parity_worker.py), and keep their reports for parity_report
    (or in `reports`). This only saves start-ups: a case the job did not finish (it
    crashed, hung or printed a traceback) is left to parity_report, which runs it alone, as
    a user would, and shows its own output. `env`: variables to add to the jobs'. Returns
    the stderr of each job that did not finish cleanly."""
    import json

    from parallel.mesh import parse_mesh

    reports = _REPORTS if reports is None else reports
    failures = []
    pending = list(dict.fromkeys(case for case in cases if (case[0], case[2], case[1]) not in reports))
    for world in sorted({parse_mesh(mesh).world_size for mesh, _, _ in pending}):
        batch = []
        for mesh, overrides, steps in pending:
            if parse_mesh(mesh).world_size == world:
                out = tmp_root / f"parity-{next(_RUNS)}.json"
                batch.append({"key": (mesh, steps, overrides), "out": out, "done": out.with_suffix(".done"),
                              "argv": parity_arguments(tmp_root, out, mesh, overrides, steps)})
        cases_file = tmp_root / f"together-{next(_RUNS)}.json"
        cases_file.write_text(json.dumps([{"argv": c["argv"], "done": str(c["done"])} for c in batch]))
        try:
            result = torchrun(world, REPO / "tests" / "shared_parity_worker.py", str(cases_file),
                              timeout=120 + 240 * len(batch), env=env)
            clean = "Traceback" not in own_output(result.stderr)
            stderr = result.stderr
        except subprocess.TimeoutExpired as timeout:
            clean, stderr = False, f"timed out after {timeout.timeout} s"
        if not clean:
            failures.append(stderr)
        for case in batch:
            if clean and case["done"].exists() and case["out"].exists():
                reports[case["key"]] = json.loads(case["out"].read_text()), int(case["done"].read_text())
    return failures


def selected(session, module: str, param: str) -> list:
    """The values of `param` in the tests of `module` that this session runs, in order."""
    return list(dict.fromkeys(item.callspec.params[param] for item in session.items
                              if item.module.__name__ == module and hasattr(item, "callspec")
                              and param in item.callspec.params))
