"""How a run ends: the exit codes, the error a rank leaves for torchrun, and the
in-process torchrun agent that `python launch/run.py` uses.

Exit codes (common/errors.py), the same for a rank and for `python launch/run.py`:
0 success or parity PASS; 1 parity FAIL or a crash (the rank prints its traceback);
2 bad input (one `error:` paragraph); 3 the loss became NaN or inf.

Under any torchrun, a rank that stops with 2 or 3 writes its paragraph to the file
torchrun names in TORCHELASTIC_ERROR_FILE, and a crash writes its traceback there.
torchrun reports the earliest such file as the root cause, so the message survives
even when torchrun stops the other ranks (rank 0 included) before they print.

`python launch/run.py` runs torchrun's agent in this process instead of exec-ing
torchrun, so it can return the ranks' own exit code and print the paragraph once,
from the error file, with no launcher traceback. On the CPU its ranks are forked from a
fork server that has imported torch and the engine once (launch/run.py:
launch_under_torchrun).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from common.errors import EXIT_FAILED, EXIT_NONFINITE_LOSS, EXIT_OK, EXIT_USER_ERROR

# Set for the ranks that our own launcher starts: the launcher prints their paragraph.
LAUNCHED_HERE = "MESHTRAIN_LAUNCHER"


def ranks_print_errors() -> bool:
    """Whether a rank prints its own error paragraph (rank 0 only), rather than our launcher."""
    return os.environ.get(LAUNCHED_HERE) != "1"


def _leave(data: dict) -> None:
    """Write `data` where torchrun looks for a rank's root cause, whole or not at all.
    torchrun's agent reads the error file of every rank that failed and dies on one that
    is not JSON, and it stops a node's other ranks as soon as one fails: a rank stopped
    while writing its file left it empty, and the agent died with JSONDecodeError instead
    of restarting the node (tests/test_multinode.py, under CPU load)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        partial = f"{path}.{os.getpid()}.partial"
        with open(partial, "w") as out:
            json.dump(data, out)
        os.replace(partial, path)


def leave_error(paragraph: str) -> None:
    """The paragraph, for torchrun to report as the root cause."""
    _leave({"message": paragraph, "timestamp": int(time.time())})


def leave_crash(err: BaseException) -> None:
    """A crash's traceback, in the format of torchrun's own error files (its ErrorHandler)."""
    import traceback
    _leave({"message": {"message": f"{type(err).__name__}: {err}",
                        "extraInfo": {"py_callstack": "".join(traceback.format_exception(err)),
                                      "timestamp": str(int(time.time()))}}})


def _paragraph(failure) -> str | None:
    """The paragraph a rank left with leave_error, or None (a crash, a signal, no file)."""
    message = failure.message
    return message if isinstance(message, str) and message.startswith("error: ") else None


def exit_code_of(failure) -> int:
    """A rank's code as the table above has it; a signal or an unknown code is a crash."""
    code = failure.exitcode
    return code if code in (EXIT_FAILED, EXIT_USER_ERROR, EXIT_NONFINITE_LOSS) else EXIT_FAILED


def run_agent(torchrun_args: list[str], rank_function=None, preload: tuple[str, ...] = ()) -> int:
    """torchrun with these arguments, run in this process; returns the exit code. With
    `rank_function` (picklable: a module-level function), the ranks are forked from a fork
    server that has imported the modules `preload` names, and run it with the script's
    arguments instead of starting the script in a new interpreter each."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's own log lines (rendezvous, "worker group failed", ...) would bury the
    # ranks' output; what matters of them is reported below. So would the line torch's
    # process context logs for each rank it stops after the first one failed: the ranks
    # that were slower to reach the same error (a loaded machine) are stopped, not failed.
    for agent_logger in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):
        logging.getLogger(agent_logger).setLevel(logging.CRITICAL)
    os.environ[LAUNCHED_HERE] = "1"
    args = parse_args(torchrun_args)
    try:
        if rank_function is None:
            run(args)
        else:
            _launch_from_fork_server(args, rank_function, preload)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        paragraph = _paragraph(failure)
        if paragraph is not None:
            print(paragraph, file=sys.stderr)
        elif failure.exitcode < 0:
            print(f"error: rank {rank} was stopped by signal {failure.signal_name()}.", file=sys.stderr)
        return exit_code_of(failure)
    return EXIT_OK


def _launch_from_fork_server(args, rank_function, preload: tuple[str, ...]) -> None:
    """What torchrun's own `run` does for a --standalone launch, with the ranks running
    `rank_function(script arguments)`, forked by multiprocessing's fork server: one process,
    started once, that imports `preload` and then forks every rank. Forking them from this
    process instead is not safe: the agent's threads (its rendezvous store's server among
    them) may hold a lock at the moment of a fork, and the forked rank then waits for it
    forever (seen: a rank of 8 stuck in getaddrinfo on glibc's resolver lock). The fork
    server has one thread."""
    import multiprocessing
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    elastic_launch(config, rank_function)(args.training_script_args)


def prepare_forked_rank() -> None:
    """Make a rank forked by the fork server write as a spawned one does: unbuffered, as
    torchrun's `python -u` makes it, so that its lines keep their order with the other
    ranks' and none is lost when the agent stops it."""
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
