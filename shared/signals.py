"""Clean shutdown on Ctrl-C or SIGTERM: for trio processes, cancel the main scope and remember why; before trio
runs (checks, imports, the model build), know that Ctrl-C came even when a library swallowed the interrupt."""

from __future__ import annotations

import contextlib
import signal
import threading
import types
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import trio

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopper:
    """Cancels `scope` on the first SIGINT/SIGTERM; `signal_name` says which one arrived (None: none). Started with
    `await nursery.start(stopper.run, scope)` before the process says it is up: from then on a stop signal is caught
    (before, it is trio's Ctrl-C, or lost where the parent left SIGINT ignored)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    async def run(
        self,
        scope: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]
    ) -> None:
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            task_status.started()
            async for signum in signals:
                self.signal_name = signal.Signals(signum).name
                scope.cancel()
                return


def ctrl_c_handled() -> None:
    """Tell CPython that a Ctrl-C we caught was handled. A KeyboardInterrupt raised inside `exec` of a string
    (dataclasses and namedtuples build their methods that way, so an import can be hit) sets CPython's "unhandled
    Ctrl-C" flag even when we catch it, and `python -m` then dies by SIGINT instead of returning our exit code; a
    successful `exec` of a string clears that flag (CPython's run_eval_code_obj resets it)."""
    exec("")  # noqa: S102 - a constant empty string; the point is the side effect above


class CtrlCWatch:
    """Python's own Ctrl-C (KeyboardInterrupt where it lands) that also remembers it came. A library may turn the
    interrupt into another error: cut inside `import numpy.dtypes`, numpy's lazy attribute recurses, and transformers
    reports "Could not import module 'Qwen2ForCausalLM'". A start-up that fails after Ctrl-C was stopped by the user.
    Used as a context manager around start-up; `trio_owns_ctrl_c` lends Ctrl-C back for trio.run."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None

    def _handler(self, signum: int, frame: types.FrameType | None) -> None:
        self.seen = True
        signal.default_int_handler(signum, frame)

    def stopped(self, exc: BaseException) -> bool:
        """Whether Ctrl-C ended the start-up that raised `exc`: it came (whatever became of it), or `exc` is the
        interrupt and nothing else (trio wraps what reaches it in exception groups; an `exec` may raise it bare)."""
        if self.seen:
            return True
        if isinstance(exc, BaseExceptionGroup):
            return exc.split(KeyboardInterrupt)[1] is None
        return isinstance(exc, KeyboardInterrupt)

    def __enter__(self) -> CtrlCWatch:
        # Ctrl-C ignored (a background job of a shell) stays ignored; None: a handler not set from Python.
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@contextlib.contextmanager
def trio_owns_ctrl_c() -> Iterator[None]:
    """Python's default Ctrl-C handler for the duration: trio.run takes Ctrl-C over (delivering it at checkpoints)
    only where it finds that handler, and a KeyboardInterrupt raised at any bytecode could break trio's own state.
    A Ctrl-C that the CtrlCWatch saw come during start-up, and that a library swallowed without a trace, is raised
    here: the user asked the start-up to stop. Without a watch (Ctrl-C ignored, a run in-process) nothing changes."""
    watch = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    if not isinstance(watch, CtrlCWatch):  # no start-up watched here (a test's in-process run, say)
        yield
        return
    if watch.seen:
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, watch._handler)


@contextlib.contextmanager
def children_ignore_ctrl_c() -> Iterator[None]:
    """Ctrl-C ignored while child processes start inside: a spawned or forkserver interpreter keeps an inherited
    SIG_IGN (Python installs its KeyboardInterrupt handler only over SIG_DFL), so the terminal's Ctrl-C, sent to
    the whole process group, reaches only this process, which stops its children itself; a child interrupted
    mid-import or mid-job would print its own traceback around our one line. Outside the main thread (where
    handlers cannot be set) the child is started as is, and must ignore Ctrl-C itself first thing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
