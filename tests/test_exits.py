"""Exit codes and error reports, as a user meets them (launch/exits.py): through
`python launch/run.py`, which runs torchrun's agent in-process, and under the user's
own torchrun. Real launches: torchrun over gloo on the CPU, 2 ranks."""

import subprocess
import sys

import pytest

from tests.distributed import REPO, cpu_env, free_port, launcher

CRASHING = ("--set", "model.plugin=tests.crashing_model", "--set", "model.name=crashing")


@pytest.mark.distributed
@pytest.mark.compat
def test_a_crash_in_the_ranks_exits_1_with_their_traceback_only(tmp_path):
    result = launcher("--mesh", "dp=2", *CRASHING, "--set", f"run.dir={tmp_path}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "RuntimeError: planted crash in forward" in result.stderr
    assert "ChildFailedError" not in result.stderr and "torch/distributed/run.py" not in result.stderr


@pytest.mark.distributed
@pytest.mark.compat
def test_user_torchrun_reports_our_paragraph_as_the_root_cause():
    """Rank 1 may exit first and torchrun may stop rank 0 before it prints: the paragraph
    still reaches the summary, through the error file every rank writes."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()),
                             str(REPO / "launch" / "run.py"), "--mesh", "dp=3,tp=2"],
                            cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    root_cause = result.stderr[result.stderr.index("Root Cause"):]
    assert "exitcode  : 2" in root_cause
    assert "error: --mesh dp=3,tp=2 needs 6 ranks but the world size is 2." in root_cause, root_cause


@pytest.mark.distributed
def test_user_torchrun_reports_a_crash_with_its_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()),
                             str(REPO / "launch" / "run.py"), "--mesh", "dp=2", *CRASHING,
                             "--set", f"run.dir={tmp_path}"],
                            cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)
    root_cause = result.stderr[result.stderr.index("Root Cause"):]
    assert "RuntimeError: planted crash in forward" in root_cause, root_cause


def test_every_script_with_a_process_group_leaves_without_teardown():
    """torch 2.13 CPU aborts about one exit in ten after destroy_process_group (SIGABRT in
    C++ static destructors); a rank that aborts fails its torchrun, so every script that
    torchrun starts leaves through parallel.process_group.exit_without_teardown."""
    scripts = [path for folder in ("tests", "bench", "examples", "launch")
               for path in sorted((REPO / folder).glob("*.py"))
               if not path.name.startswith("test_") and '__name__ == "__main__"' in path.read_text()
               and ("init_process_group(" in path.read_text() or "start_process_group(" in path.read_text())]
    assert len(scripts) >= 9, scripts
    missing = [str(path.relative_to(REPO)) for path in scripts if "exit_without_teardown(" not in path.read_text()]
    assert not missing, f"these scripts leave through interpreter teardown: {missing}"


@pytest.mark.parametrize("gpus, device, forked", [(0, "cpu", True), (1, "cpu", False), (0, "cuda", False)])
def test_cpu_ranks_are_forked_only_where_no_gpu_shows(monkeypatch, gpus, device, forked):
    """Unit test (no process group: run_agent is replaced). On an H200 with torch 2.11, a
    CPU run's forked ranks failed in optimizer.step ("CUDA error: initialization error"):
    torchrun's agent had asked CUDA for the GPUs before it forked them."""
    import torch

    from launch import run
    seen = {}

    def agent(args, rank_function, preload):
        seen["rank"] = rank_function
        return 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(run, "run_agent", agent)
    run.launch_under_torchrun(2, ["--mesh", "dp=2"], device)
    assert (seen["rank"] is run.forked_rank) == forked


@pytest.mark.distributed
def test_a_rank_stopped_after_another_failed_adds_nothing_to_the_paragraph(tmp_path):
    """Rank 0 fails at once while rank 1 is still working, as when a loaded machine slows
    one rank on its way to the same error: the agent stops rank 1, and the user still reads
    the one paragraph, with no log line of torch's about the stopping (in CI a `Terminating
    process ... via signal SIGTERM` line came first)."""
    script = tmp_path / "one_rank_fails.py"
    script.write_text("import os, time\n"
                      "from launch.exits import leave_error\n"
                      "from parallel.process_group import exit_without_teardown\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    leave_error('error: rank 0 found bad input.')\n"
                      "    exit_without_teardown(2)\n"
                      "time.sleep(120)\n")
    result = subprocess.run([sys.executable, str(REPO / "tests" / "forked_torchrun.py"), "2", str(script)],
                            cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=100)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "error: rank 0 found bad input.\n"
