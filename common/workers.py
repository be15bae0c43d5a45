"""Worker processes that a dead worker cannot hang.

multiprocessing.Pool and concurrent.futures' pool pass tasks and results through queues
that their workers share under a lock. A worker killed while it holds that lock, or while
it sends a result (a kill of the whole process group, the kernel's out-of-memory killer),
leaves the parent waiting for good; and Pool replaces a worker that died with a new one
while the task it held is never answered. launch/prepare.py and the planner's search both
hung so (tests/test_prepare.py, tests/test_dryrun.py). Here each worker has a pipe of
its own and holds one task at a time: a worker's death reads as an end of file there and
is raised as WorkerDied, and the workers are killed whenever the results end.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import traceback
from multiprocessing.connection import wait

_END = object()


class WorkerDied(Exception):
    """A worker process ended while it held a task, or before it could take one."""

    def __init__(self, exitcode: int | None):
        self.exitcode = exitcode
        killed = f"killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
        super().__init__(f"a worker process ended before its work was done ({killed}: out of memory, or killed?)")


class WorkerTraceback(Exception):
    """Where a worker raised: the cause of the exception re-raised in the parent."""


def _serve(connection, function, initializer, initargs) -> None:
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            task = connection.recv()
        except EOFError:  # the parent closed its end, or died
            return
        try:
            reply = (True, function(task), None)
        except Exception as err:
            text = traceback.format_exc()
            try:
                pickle.dumps(err)
            except Exception:
                err = RuntimeError(f"{type(err).__name__}: {err}")
            reply = (False, err, text)
        connection.send(reply)


def imap(function, tasks, workers: int, initializer=None, initargs: tuple = (), ordered: bool = True):
    """function(task) for each of `tasks`, computed in `workers` spawned processes (a fork
    would copy locks that other threads hold), each of which runs initializer(*initargs)
    first. Results come in the tasks' order (ordered), or as they are done; tasks are read
    from `tasks` only as workers free up, and with `ordered` at most 2 x workers of them
    are read and not yet yielded. An exception a worker raises is raised here, caused by
    its traceback there. The workers start with SIGINT ignored, and keep it so: Ctrl-C
    reaches the whole process group, and stopping is the parent's to do. Close the
    generator (contextlib.closing) to stop early: the workers are killed then."""
    context = multiprocessing.get_context("spawn")
    processes = {}  # our end of each worker's pipe -> its process
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for _ in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, function, initializer, initargs), daemon=True)
            process.start()
            theirs.close()  # so that the worker's death reads as an end of file
            processes[ours] = process
    finally:
        signal.signal(signal.SIGINT, interrupt)
    tasks, busy, waiting = iter(tasks), {}, {}  # busy: connection -> its task's index; waiting: index -> result
    sent = next_out = 0
    exhausted = False
    try:
        while True:
            for connection in [c for c in processes if c not in busy]:
                if exhausted or (ordered and sent - next_out >= 2 * workers):
                    break
                task = next(tasks, _END)
                if task is _END:
                    exhausted = True
                    break
                _talk(connection, processes, task)
                busy[connection] = sent
                sent += 1
            if not busy:
                return
            for connection in wait(list(busy)):
                index = busy.pop(connection)
                done, value, text = _talk(connection, processes)
                if not done:
                    raise value from WorkerTraceback(text)
                if not ordered:
                    yield value
                else:
                    waiting[index] = value
                    while next_out in waiting:
                        yield waiting.pop(next_out)
                        next_out += 1
    finally:
        for connection, process in processes.items():
            process.kill()
            process.join()
            connection.close()


def _talk(connection, processes, task=_END):
    """Sends `task`, or without one, receives a reply; a dead worker raises WorkerDied."""
    try:
        return connection.recv() if task is _END else connection.send(task)
    except (EOFError, OSError):  # OSError: it died while a message was under way
        process = processes[connection]
        process.join(5)
        raise WorkerDied(process.exitcode) from None
