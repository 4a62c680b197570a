"""Clean shutdown on Ctrl-C or SIGTERM for trio processes: cancel the main scope, remember why."""

from __future__ import annotations

import signal

import trio

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopper:
    """Cancels `scope` on the first SIGINT/SIGTERM; `signal_name` says which one arrived (None: none)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    async def run(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
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
