"""The CPU budget of one reward check: past it, the check is the submitter's doing, not the operator's.

A reward runs on text a node sent, so a node can choose text that makes it slow (a math answer sympy
expands for minutes). `cpu_budget` bounds the CPU one check may spend. On a process's main thread (a
check worker's) a CPU timer (ITIMER_PROF) interrupts the check with OverBudget once the budget is spent,
and again every OVERRUN_REPEAT_S of CPU after, so code that catches it and carries on is interrupted
again. A thread cannot be interrupted: there the CPU the thread spent is measured when the check
returns, and a check over its budget raises OverBudget then (a check that never returns is bounded by
its caller: hub/trust/checkpool.py). CPU rather than wall time: a loaded machine or a reward waiting on
I/O does not charge an honest node.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# After the first interrupt, CPU seconds between the next ones (a reward that swallowed one keeps getting them).
OVERRUN_REPEAT_S = 0.05


class OverBudget(BaseException):  # noqa: N818 -- a BaseException: a reward's own `except Exception` cannot swallow it
    """A reward check spent more than its CPU budget on a node's text: counted against that node."""


def _interruptible() -> bool:
    """Whether a CPU timer can interrupt this thread: only a process's main thread receives signals."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def cpu_budget(seconds: float) -> Iterator[None]:
    """Run the block within `seconds` of CPU, else raise OverBudget (see the module docstring)."""
    fired = False
    timer = _interruptible()
    if timer:

        def interrupt(_signum: int, _frame: object) -> None:
            nonlocal fired
            fired = True
            raise OverBudget(f"ran past its {seconds:g} s CPU budget")

        previous = signal.signal(signal.SIGPROF, interrupt)
        signal.setitimer(signal.ITIMER_PROF, seconds, OVERRUN_REPEAT_S)
    start = time.thread_time()
    try:
        yield
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_PROF, 0.0)
            signal.signal(signal.SIGPROF, previous)
    spent = time.thread_time() - start
    if fired or spent > seconds:
        raise OverBudget(f"ran past its {seconds:g} s CPU budget ({spent:.2f} s)")
