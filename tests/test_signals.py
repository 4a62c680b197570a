"""shared.signals.Stopper: once `nursery.start` returns it, a stop signal cancels the scope, even in a process whose
parent left SIGINT ignored (a forkserver child; CI's hub stopped on seeing its address kept running when the stopper
was only scheduled)."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from shared.signals import Stopper


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_sent_as_soon_as_the_stopper_started_cancels_the_scope(sig: signal.Signals) -> None:
    stopper = Stopper()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a forkserver started under SIG_IGN hands it down

    async def main() -> bool:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(stopper.run, nursery.cancel_scope)
                os.kill(os.getpid(), sig)  # no checkpoint between the start and the signal
                await trio.sleep_forever()
        return nursery.cancel_scope.cancelled_caught

    try:
        assert trio.run(main)
        assert stopper.signal_name == sig.name
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the stopper gave the handler back
    finally:
        signal.signal(signal.SIGINT, previous)
