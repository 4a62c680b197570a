"""A failed exchange with a peer (a dial, a request, a stream cut short), told to people as one plain sentence: what
happened, never an exception's class name or repr. Terminals and the events nodes print show `plain_failure`'s words;
the exception itself goes to the log file only."""

from __future__ import annotations

import errno

import trio

from shared.wire import FrameError, StreamEOF

# How a peer's failure reads: a timeout anywhere in the exception's chain, else the first kind found in it.
TIMED_OUT = "did not answer in time"
REFUSED = "refused the connection: nothing listens at its address (not started yet, stopped, or restarting)"
CLOSED = "closed the connection in the middle of an exchange (it stopped, restarted or dropped the stream)"
HANDSHAKE = "failed the connection's encrypted handshake"
UNREADABLE = "answered with a message this version of echo2 cannot read"
NO_ROUTE = "cannot be reached: the network has no route to its address"
# py-libp2p does not dial a peer whose every address failed moments ago (its "negative cache"): the dial before said why.
RECENTLY = "could not be reached at its address a moment ago"
UNREACHABLE = "could not be reached, or did not answer"


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and every exception inside it: exception groups' members, libp2p MultiError's `errors`, causes and
    contexts; each once, outermost first."""
    found: list[BaseException] = []
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        members = getattr(current, "exceptions", None) or getattr(current, "errors", None) or ()
        todo += [m for m in members if isinstance(m, BaseException)]
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return found


def _closed_kinds() -> tuple[type[BaseException], ...]:
    """The ways a stream or connection ends under us: ours, trio's and py-libp2p's (imported when first needed, as
    shared.wire.libp2p_end_of_stream does)."""
    from libp2p.stream_muxer.exceptions import MuxedConnUnavailable

    from shared.wire import libp2p_end_of_stream

    return (
        StreamEOF,
        EOFError,
        trio.BrokenResourceError,
        trio.ClosedResourceError,
        MuxedConnUnavailable,
        *libp2p_end_of_stream(),
    )


def _kind(exc: BaseException) -> str | None:
    """The sentence one exception of the chain says on its own; None when it says nothing plainer than the rest."""
    from libp2p.transport.exceptions import UpgradeFailure

    text = str(exc)
    if isinstance(exc, trio.TooSlowError | TimeoutError) or "timed out" in text:
        return TIMED_OUT
    if isinstance(exc, ConnectionRefusedError) or "Connection refused" in text or "connection refused" in text:
        return REFUSED
    if isinstance(exc, UpgradeFailure):
        return HANDSHAKE
    if isinstance(exc, FrameError):
        return UNREADABLE
    if isinstance(exc, _closed_kinds()) or isinstance(exc, ConnectionResetError | BrokenPipeError):
        return CLOSED
    if isinstance(exc, OSError) and exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return NO_ROUTE
    if "recently failed all addresses" in text:
        return RECENTLY
    return None


def plain_failure(exc: BaseException) -> str:
    """What went wrong with the peer, as the end of a sentence whose subject is the peer ("the hub ..."): e.g. "did
    not answer in time", "refused the connection: nothing listens at its address (...)". Any failure names one."""
    chain = _chain(exc)
    # A timeout anywhere explains the rest (a dial cancelled by it reports a failed dial).
    kinds = [kind for kind in map(_kind, chain) if kind is not None]
    if TIMED_OUT in kinds:
        return TIMED_OUT
    return kinds[0] if kinds else UNREACHABLE
