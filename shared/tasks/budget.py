"""The CPU budget of one reward check: past it, the check is the submitter's doing, not the operator's.

A reward runs on text a node sent, so a node can choose text that makes it slow (a math answer sympy
expands for minutes). `cpu_budget` bounds the CPU one check may spend. On a process's main thread (a
check worker's) a watchdog thread reads the main thread's CPU clock and interrupts the check with
OverBudget (a SIGPROF sent to that thread) once the budget is spent, and again every OVERRUN_REPEAT_S of
CPU after, so code that catches it and carries on is interrupted again. A CPU interval timer
(ITIMER_PROF) would be simpler, but the kernel checks it on the scheduler's tick of the CPU running the
process: on a machine busy with other work the time slices fall between ticks, and it fired never in a
second of CPU. A thread cannot be interrupted: there the CPU the thread spent is measured when the check
returns, and a check over its budget raises OverBudget then (a check that never returns is bounded by
its caller: hub/trust/checkpool.py). CPU rather than wall time: a loaded machine or a reward waiting on
I/O does not charge an honest node.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# After the first interrupt, CPU seconds between the next ones (a reward that swallowed one keeps getting them).
OVERRUN_REPEAT_S = 0.05
# How often the watchdog reads the main thread's CPU clock while a budget runs (wall seconds): the most CPU a check
# spends past its budget before it is interrupted.
WATCH_PERIOD_S = 0.01


class OverBudget(BaseException):  # noqa: N818 -- a BaseException: a reward's own `except Exception` cannot swallow it
    """A reward check spent more than its CPU budget on a node's text: counted against that node."""


class _Watchdog:
    """One thread per process, asleep while no budget runs: it signals the main thread once the main thread's CPU
    clock passes the armed deadline, then every OVERRUN_REPEAT_S of CPU, until disarmed."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has no thread of its parent's: it starts its own
        self.main = threading.main_thread()
        self.clock = time.pthread_getcpuclockid(self.main.ident)  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self._armed = threading.Event()
        self._deadline = math.inf
        threading.Thread(target=self._run, name="echo2-cpu-budget", daemon=True).start()

    def arm(self, deadline: float) -> None:
        with self._lock:
            self._deadline = deadline
            self._armed.set()

    def disarm(self) -> None:
        """After this returns no signal is sent; one sent before it is taken by the main thread before it goes on
        (a signal sent to a thread is delivered as it next runs)."""
        with self._lock:
            self._armed.clear()
            self._deadline = math.inf

    def _run(self) -> None:
        while True:
            self._armed.wait()
            time.sleep(WATCH_PERIOD_S)
            with self._lock:
                if self._armed.is_set() and time.clock_gettime(self.clock) >= self._deadline:
                    self._deadline = time.clock_gettime(self.clock) + OVERRUN_REPEAT_S
                    signal.pthread_kill(self.main.ident, signal.SIGPROF)  # type: ignore[arg-type]


_watchdog: _Watchdog | None = None


def _interruptible() -> bool:
    """Whether the check can be interrupted: only a process's main thread runs signal handlers."""
    return hasattr(time, "pthread_getcpuclockid") and threading.current_thread() is threading.main_thread()


@contextmanager
def cpu_budget(seconds: float) -> Iterator[None]:
    """Run the block within `seconds` of CPU, else raise OverBudget (see the module docstring)."""
    global _watchdog
    fired = stopping = False
    interruptible = _interruptible()
    if interruptible:

        def interrupt(_signum: int, _frame: object) -> None:
            nonlocal fired
            fired = True
            if not stopping:
                raise OverBudget(f"ran past its {seconds:g} s CPU budget")

        if _watchdog is None or _watchdog.pid != os.getpid():
            _watchdog = _Watchdog()
        previous = signal.signal(signal.SIGPROF, interrupt)
    start = time.thread_time()
    if interruptible:
        assert _watchdog is not None
        _watchdog.arm(time.clock_gettime(_watchdog.clock) + seconds)
    try:
        yield
    finally:
        while interruptible:
            # A signal may raise before `stopping` is set (even as this block begins): then the block runs again. Once
            # it is set none raises, so the watchdog is disarmed and the handler given back whatever the timing.
            try:
                stopping = True
                assert _watchdog is not None
                _watchdog.disarm()
                signal.signal(signal.SIGPROF, previous)
                break
            except OverBudget:
                continue
    spent = time.thread_time() - start
    if fired or spent > seconds:
        raise OverBudget(f"ran past its {seconds:g} s CPU budget ({spent:.2f} s)")
