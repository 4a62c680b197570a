"""Probe back-off: an identity, or an address, whose probe leases go unanswered waits longer for the next one, and
an identity that leaves PROBE_STRIKES_TO_STANDBY rounds of them unanswered is set to standby.

A probe is the one-prompt lease that measures a new node. Identities are free, so before this an attacker's 48
identities on 6 addresses each held a probe they never answered, had it re-leased at once when it expired, and
(since probes counted in every other node's room) stopped the learner (issue 65). Probes no longer count in the
others' room (hub/service/leasing.py); this makes an unanswered one cost its holder. The first wait is one lease
timeout (the probe held its prompt that long: the holder then waits as long as it held it), and it doubles with each
round of unanswered probes of the identity, and separately of its address, so fresh identities on one address
inherit the address's wait (probes expiring while a wait runs do not lengthen it: it grows per round, not per
identity, so a shared address of honest nodes is not locked out by one bad night). An answered probe clears both.
An honest node slower than the lease timeout on a loaded machine loses a few lease timeouts, not its place: it is
set to standby only after PROBE_STRIKES_TO_STANDBY rounds. The tables keep the most recent STRIKE_TABLE_SIZE entries each:
throwaway identities must not grow them.

Pure bookkeeping on the caller's clock; it decides and counts, and writes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PROBE_BACKOFF_MAX_S = 3600.0
# Rounds of unanswered probes after which an identity is set to standby (it may join again, and its wait goes on).
PROBE_STRIKES_TO_STANDBY = 4
STRIKE_TABLE_SIZE = 4096


@dataclass
class _Strikes:
    count: int
    last_at: float


def backoff_s(strikes: int, first_s: float) -> float:
    """The wait after `strikes` rounds of unanswered probes: none, then `first_s` doubling, at most PROBE_BACKOFF_MAX_S."""
    if strikes <= 0:
        return 0.0
    return min(first_s * 2.0 ** min(strikes - 1, 32), PROBE_BACKOFF_MAX_S)


class ProbeStrikes:
    """Unanswered probes per identity and per address key; see the module docstring."""

    def __init__(self, first_wait_s: float, table_size: int = STRIKE_TABLE_SIZE) -> None:
        """`first_wait_s`: the wait after a first round (the hub's lease timeout)."""
        self.first_wait_s = first_wait_s
        self.table_size = table_size
        self._by_peer: OrderedDict[str, _Strikes] = OrderedDict()
        self._by_address: OrderedDict[str, _Strikes] = OrderedDict()

    def wait_s(self, peer: str, address: str | None, now: float) -> float:
        """How long `peer` (at `address`, None for the operator's own nodes) must still wait for a probe."""
        waits = [self._wait(self._by_peer.get(peer), now)]
        if address is not None:
            waits.append(self._wait(self._by_address.get(address), now))
        return max(waits)

    def unanswered(self, peer: str, address: str | None, now: float) -> int:
        """A probe of `peer` expired unanswered: its strikes now (its address's grow too)."""
        count = self._strike(self._by_peer, peer, now)
        if address is not None:
            self._strike(self._by_address, address, now)
        return count

    def answered(self, peer: str, address: str | None) -> None:
        """A probe answered: the identity and its address start clean."""
        self._by_peer.pop(peer, None)
        if address is not None:
            self._by_address.pop(address, None)

    def _wait(self, strikes: _Strikes | None, now: float) -> float:
        if strikes is None:
            return 0.0
        return max(0.0, strikes.last_at + backoff_s(strikes.count, self.first_wait_s) - now)

    def _strike(self, table: OrderedDict[str, _Strikes], key: str, now: float) -> int:
        strikes = table.pop(key, None) or _Strikes(0, now)
        # Probes that expire within a wait already running (an address's identities, leased together) lengthen it
        # once, not once each: the wait grows with the rounds of unanswered probes, not with identities.
        if self._wait(strikes, now) <= 0:
            strikes.count += 1
            strikes.last_at = now
        table[key] = strikes
        while len(table) > self.table_size:
            table.popitem(last=False)
        return strikes.count
