"""common/workers.py: results in order or as done, bounded reading ahead, a worker's
exception raised in the parent, and a worker's death an error rather than a hang.
Real spawned processes (2 each), no process group."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from contextlib import closing

import pytest

from common.workers import WorkerDied, WorkerTraceback, imap


def slow_square(x: int) -> int:
    time.sleep(0.03 * (x % 3))  # later tasks often finish first
    return x * x


def square_slow_first(x: int) -> int:
    if x == 0:
        time.sleep(1.5)  # the other worker meanwhile does the tasks after it, up to the bound
    return x * x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError(f"task {x} is bad")
    return x


def die_on_three(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
    return x


def sigint_handler(_: int) -> bool:
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_results_come_in_order_and_the_tasks_are_read_only_two_per_worker_ahead():
    pulled, workers = [], 2

    def tasks():
        for x in range(12):
            pulled.append(x)
            yield x

    taken, ahead = [], []
    for result in imap(square_slow_first, tasks(), workers):
        ahead.append(len(pulled) - len(taken))
        taken.append(result)
    assert taken == [x * x for x in range(12)]
    assert max(ahead) == 2 * workers, ahead
    assert multiprocessing.active_children() == []


def test_unordered_results_are_each_task_once():
    assert sorted(imap(slow_square, range(9), 2, ordered=False)) == [x * x for x in range(9)]


def test_a_workers_exception_is_raised_here_with_its_traceback_there():
    with pytest.raises(ValueError, match="task 3 is bad") as raised:
        list(imap(fail_on_three, range(6), 2))
    assert isinstance(raised.value.__cause__, WorkerTraceback)
    assert "fail_on_three" in str(raised.value.__cause__)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("ordered", [True, False])
def test_a_worker_that_dies_is_an_error_not_a_hang(ordered):
    """multiprocessing.Pool starts a new worker in its place, and the task it held is never
    answered: the planner's search waited for good (checked by hand: a debug-model search
    with one worker SIGKILLed was still waiting 400 s later)."""
    started = time.monotonic()
    with pytest.raises(WorkerDied, match="killed by signal 9") as raised:
        list(imap(die_on_three, range(8), 2, ordered=ordered))
    assert raised.value.exitcode == -signal.SIGKILL
    assert time.monotonic() - started < 60
    assert multiprocessing.active_children() == []


def test_stopping_early_kills_the_workers_and_they_ignore_ctrl_c():
    with closing(imap(sigint_handler, range(100), 2)) as results:
        assert next(results) is True  # SIGINT is the parent's to act on
        assert len(multiprocessing.active_children()) == 2
    assert multiprocessing.active_children() == []
