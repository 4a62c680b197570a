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
