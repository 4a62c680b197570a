"""Status watchers: the peers that have not joined which may keep their connection past the stranger lifetime.

A peer that has not joined is let go after the stranger lifetime however busy (hub/service/handlers.py), so that
throwaway identities cannot hold the hub's connections by polling its status. A remote dashboard
(`echo-hub dashboard --hub`) or a monitoring script is such a peer too, and was cut off at every poll once past it.
A watcher keeps its connection while it keeps to the hub's limits: its last status request was answered no longer
than the idle limit ago (one throttled by the per-address status rate is no answer), the peer guard has not
disconnected it nor has it sent anything refused as its own fault (then it is no watcher for REFUSED_KEPT_S), and it
holds one of the `per_address` places of its address and of the `total` places in all, first come. Past a bound it is
a stranger like any other: a flood of polite identities still holds no more than `total` connections past the
lifetime. The table itself holds at most `kept` peers: past it, a peer answered for the first time takes the entry of
the one answered longest ago that holds no place (a watcher still polling comes back with its next answer), so
throwaway identities whose status was answered cannot grow it.

Plain bookkeeping with the clock passed in; the hub calls it from its trio thread.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

# Places per address key: a dashboard polls at half the per-address status rate (tui/cli.py), so two share it fully.
WATCHERS_PER_ADDRESS = 4
WATCHERS_TOTAL = 64
# How long a peer refused as at fault (or disconnected by the guard) may not be a watcher.
REFUSED_KEPT_S = 600.0
# Refused peers remembered at most (the newest): throwaway identities cannot grow the table.
REFUSED_MAX = 4096
# Peers whose status was answered remembered at most (those holding a place, and the most recently answered of the rest).
WATCHERS_KEPT_MAX = 4096


@dataclass
class _Watcher:
    address: str  # its address key (hub/service/handlers.py keys the status rate the same way)
    answered_at: float
    placed: bool = False


class StatusWatchers:
    """Which peers that have not joined poll the status within the limits, and which of them hold a place."""

    def __init__(
        self, idle_s: float, per_address: int = WATCHERS_PER_ADDRESS, total: int = WATCHERS_TOTAL, kept: int = WATCHERS_KEPT_MAX
    ) -> None:
        if kept <= total:
            raise ValueError(f"kept ({kept}) must be more than the places in all ({total}): a new peer needs room")
        self.idle_s = idle_s  # trust.idle_connection_s: a watcher answered longer ago than this stopped polling
        self.per_address = per_address
        self.total = total
        self.kept = kept
        # Least recently answered first: a new peer past `kept` takes the first entry holding no place.
        self._watchers: dict[str, _Watcher] = {}
        self._placed: Counter[str] = Counter()  # places held per address key
        self._refused: dict[str, float] = {}  # peer -> when refused, oldest first

    @property
    def placed(self) -> int:
        """Places held in all."""
        return self._placed.total()

    def answered(self, peer: str, address: str, now: float) -> None:
        """A status request of `peer`, from `address` (its address key), was answered."""
        if peer in self._refused:
            return
        watcher = self._watchers.get(peer)
        if watcher is not None and watcher.address == address:
            watcher.answered_at = now
            self._watchers[peer] = self._watchers.pop(peer)  # to the end: answered most recently
            return
        self._drop(peer)  # new, or back from another address: placed anew
        if len(self._watchers) >= self.kept:
            # At most `total` entries hold a place, fewer than `kept`: one of the first total + 1 holds none.
            self._drop(next(p for p, w in self._watchers.items() if not w.placed))
        self._watchers[peer] = _Watcher(address, now)

    def refused(self, peer: str, now: float) -> None:
        """`peer` was refused as at fault, or disconnected by the guard: no watcher for REFUSED_KEPT_S."""
        self._drop(peer)
        self._refused.pop(peer, None)
        self._refused[peer] = now
        if len(self._refused) > REFUSED_MAX:
            del self._refused[next(iter(self._refused))]

    def keeps(self, peer: str, now: float) -> bool:
        """Whether `peer`, past the stranger lifetime, keeps its connection: a watcher in good standing holding a
        place, or one free now, which it takes."""
        watcher = self._watchers.get(peer)
        if watcher is None or now - watcher.answered_at > self.idle_s:
            return False
        if not watcher.placed:
            if self.placed >= self.total or self._placed[watcher.address] >= self.per_address:
                return False
            watcher.placed = True
            self._placed[watcher.address] += 1
        return True

    def prune(self, now: float) -> None:
        """Forget the watchers that stopped polling (gone, or joined; their places go back) and refusals past
        REFUSED_KEPT_S."""
        for peer in [p for p, w in self._watchers.items() if now - w.answered_at > self.idle_s]:
            self._drop(peer)
        while self._refused and now - next(iter(self._refused.values())) > REFUSED_KEPT_S:
            del self._refused[next(iter(self._refused))]

    def _drop(self, peer: str) -> None:
        watcher = self._watchers.pop(peer, None)
        if watcher is not None and watcher.placed:
            self._placed[watcher.address] -= 1
            if not self._placed[watcher.address]:
                del self._placed[watcher.address]
