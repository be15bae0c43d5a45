"""How a run ends: the exit codes, the error a rank leaves for torchrun, and the
in-process torchrun agent that `python launch/run.py` uses.

Exit codes (engine/errors.py), the same for a rank and for `python launch/run.py`:
0 success or parity PASS; 1 parity FAIL or a crash (the rank prints its traceback);
2 bad input (one `error:` paragraph); 3 the loss became NaN or inf.

Under any torchrun, a rank that stops with 2 or 3 writes its paragraph to the file
torchrun names in TORCHELASTIC_ERROR_FILE, and a crash writes its traceback there.
torchrun reports the earliest such file as the root cause, so the message survives
even when torchrun stops the other ranks (rank 0 included) before they print.

`python launch/run.py` runs torchrun's agent in this process instead of exec-ing
torchrun, so it can return the ranks' own exit code and print the paragraph once,
from the error file, with no launcher traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from engine.errors import EXIT_FAILED, EXIT_NONFINITE_LOSS, EXIT_OK, EXIT_USER_ERROR

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


def run_agent(torchrun_args: list[str]) -> int:
    """torchrun with these arguments, run in this process; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's own log lines (rendezvous, "worker group failed", ...) would bury the
    # ranks' output; what matters of them is reported below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ[LAUNCHED_HERE] = "1"
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        paragraph = _paragraph(failure)
        if paragraph is not None:
            print(paragraph, file=sys.stderr)
        elif failure.exitcode < 0:
            print(f"error: rank {rank} was stopped by signal {failure.signal_name()}.", file=sys.stderr)
        return exit_code_of(failure)
    return EXIT_OK
