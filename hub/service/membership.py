"""Membership: who the hub's nodes are. It owns the fleet's node records (hub/records/fleet.py) and is their only
writer: join, heartbeat, leave, state changes, bans, re-pricing, a node's reachability as the dial-back found it,
and what its answered leases measured (booked by the intake). Every durable change goes through the one StoreWriter.

Each command writes all-or-nothing (events included) and changes the record only after its commit returns, on the
trio thread with no checkpoint in between; a commit and its record change are shielded from cancellation together.
Two changes come first, in the safe direction: a price change is counted as made before its write (a second one
racing it is already too soon), and a ban marks the record banned before its write (`mark_banned`: no
submission, join or state change of the node slips in while it is written). A ban is also checked inside every
write of a node's work.

Listeners added to `on_departure` take back the open leases of a node leaving the pool (gone, banned, said it
leaves: Leasing, built after this owner, adds itself); those added to `on_ban` forget what a banned node showed
(the intake's copy detector); those added to `on_change` hear of every change in who may
work (the broadcaster replans, the scheduler decides again).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass

import trio

from hub.config import HubConfig
from hub.method.prices import price_change_refusal, ranking_price
from hub.records.fleet import (
    DEPARTED_KEPT_S,
    IDLE_DEPARTED_KEPT_S,
    LATE_LEASES_HELD,
    PRICE_HISTORY_KEPT,
    Fleet,
    NodeRecord,
    forgettable,
    heartbeat_period,
    heartbeat_timeout,
)
from hub.records.store import Store
from hub.records.writer import StoreWriter
from hub.service.totals import RunTotals
from shared.crypto import public_key_from_peer_id
from shared.messages import LEFT_REASON, Heartbeat, JoinRequest, NodeState, RejectCode, Tallies, add_reasons
from shared.wire import PeerFault

log = logging.getLogger("echo2.hub.membership")

# One "join" event row per node per this long, however often it rejoins.
JOIN_EVENT_WINDOW_S = 60.0
# How stale the live-node count behind the heartbeat period may be.
HEARTBEAT_RECOUNT_S = 1.0


@dataclass(frozen=True)
class NodeTerms:
    """What a joining node must match: the model the hub trains and the snapshots' dtype."""

    model_config_hash: str
    model_label: str  # hub.cli.build: name (architecture, vocab), for the mismatch refusal
    snapshot_dtype: str


class Membership:
    """The fleet's node records and every write to them; see the module docstring."""

    def __init__(
        self,
        store: Store,
        writer: StoreWriter,
        config: HubConfig,
        terms: NodeTerms,
        totals: RunTotals,
        clock: Callable[[], float],
    ) -> None:
        sc = config.scheduler
        self.store = store
        self.writer = writer
        self.terms = terms
        self.totals = totals
        self.clock = clock
        self.heartbeat_timeout_s = sc.heartbeat_timeout_s
        self.min_heartbeat_period_s = sc.heartbeat_period_s
        self.heartbeats_per_s = sc.heartbeats_per_s
        self.max_price_per_hour = sc.max_price_per_hour
        self.price_change_interval_s = sc.price_change_interval_s
        self.price_band = sc.price_band
        self._heartbeat_period_s = self.min_heartbeat_period_s
        self._period_counted_at = -math.inf
        self.fleet = Fleet()
        # Called after a node joins, leaves, is banned or gets measured: chains and activation follow.
        self.on_change: list[Callable[[], None]] = []
        # Called with a node leaving the pool: its open leases go back, and what went back is returned.
        self.on_departure: list[Callable[[str], Sized]] = []
        # Called with a node banned: what it showed is no evidence against anyone (the intake's copy detector).
        self.on_ban: list[Callable[[str], object]] = []
        self._dirty: set[str] = set()  # nodes whose liveness changed since the last flush
        self._join_events: dict[str, float] = {}  # node -> when its last "join" event was written
        # The nodes the fleet let go (DEPARTED_KEPT_S, IDLE_DEPARTED_KEPT_S): how many (the status counts them as omitted),
        # and their $/h x online seconds (their share of the all-on cost).
        self.departed_count = 0
        self.departed_usd_s = 0.0

    def load(self) -> None:
        """The nodes the store remembers that were seen within DEPARTED_KEPT_S, as a restarted hub sees them (the others
        are recalled if they join again), the last seen last; blocking, runs before trio starts."""
        seen_since = self.clock() - DEPARTED_KEPT_S
        prices = self.store.members.price_history(PRICE_HISTORY_KEPT, seen_since)
        for row in sorted(self.store.members.nodes(seen_since), key=lambda row: row.last_seen):
            self.fleet.put(NodeRecord.from_row(row, tuple(prices.get(row.peer_id, ()))))
        self.departed_count, self.departed_usd_s = self.store.members.seen_before(seen_since)

    def forget_departed(self, now: float) -> None:
        """Records of nodes gone or banned leave memory: those that did nothing worth remembering (`forgettable`) once not
        seen for IDLE_DEPARTED_KEPT_S (the retention that calls this deletes their rows next, by the same cut), the others
        once not seen for DEPARTED_KEPT_S (the store keeps them)."""
        paid = self.totals.paid_usd

        def kept_s(record: NodeRecord) -> float:
            return IDLE_DEPARTED_KEPT_S if forgettable(record, paid.get(record.peer_id, 0.0)) else DEPARTED_KEPT_S

        for record in self.fleet.departed(now, kept_s):
            self.departed_count += 1
            self.departed_usd_s += record.price_per_hour * record.online_s

    async def recall(self, peer: str) -> NodeRecord | None:
        """The node's record, from the store (what it measured, its tallies, the clock of its last price change) back in
        the fleet if the fleet let it go; None for a node never seen."""
        if (record := self.fleet.get(peer)) is not None:
            return record
        remembered = await trio.to_thread.run_sync(self.store.members.remembered, peer, PRICE_HISTORY_KEPT)
        if (record := self.fleet.get(peer)) is not None or remembered is None:
            return record  # recalled by a join racing this one, or a newcomer
        row, prices = remembered
        record = NodeRecord.from_row(row, prices)
        self.fleet.put(record)
        self.departed_count -= 1
        self.departed_usd_s -= row.price_per_hour * row.online_s
        return record

    # -- reading ---------------------------------------------------------------------------

    def is_member(self, peer: str) -> bool:
        """A joined node in good standing (not gone, not banned)."""
        return self.fleet.is_member(peer)

    def known(self, peer: str) -> NodeRecord:
        """The record of a joined node, or PeerFault saying why the peer may not do this."""
        record = self.fleet.get(peer)
        if record is None or record.state == "gone":
            raise PeerFault("unknown node: join first", RejectCode.UNKNOWN_NODE)
        if record.state == "banned":
            raise PeerFault(f"banned: {record.banned_reason}", RejectCode.BANNED)
        return record

    def changed(self) -> None:
        """Tell the listeners who may work changed."""
        for listener in self.on_change:
            listener()

    def departed(self, peer: str) -> int:
        """Tell the listeners `peer` left the pool; how many of its leases went back."""
        return sum(len(listener(peer)) for listener in self.on_departure)

    # -- node lifecycle --------------------------------------------------------------------

    async def join(self, peer: str, request: JoinRequest, remote_ip: str | None) -> NodeRecord:
        terms = self.terms
        if request.model_config_hash != terms.model_config_hash:
            raise PeerFault(
                f"model config differs from the hub's: the hub trains {terms.model_label or 'another model'}; "
                "start the node without --model to use the hub's, or with that model",
                RejectCode.MODEL_MISMATCH,
            )
        if request.dtype != terms.snapshot_dtype:
            raise PeerFault(
                f"this hub publishes {terms.snapshot_dtype} snapshots and the node's engine runs "
                f"{request.dtype}: restart the node with --dtype {terms.snapshot_dtype}",
                RejectCode.MODEL_MISMATCH,
            )
        try:
            public_key_from_peer_id(peer)
        except ValueError:
            # Every commitment and signature is checked against the key inlined in the peer id.
            raise PeerFault("this peer id inlines no Ed25519 key: use an echo2 identity", RejectCode.BAD_REQUEST) from None
        if request.price_per_hour > self.max_price_per_hour:
            # Before any probe: a price above the ceiling is never worth measuring, let alone paying for.
            raise PeerFault(
                f"price ${request.price_per_hour:g}/h is above this hub's ceiling "
                f"${self.max_price_per_hour:g}/h: join with a lower --price",
                RejectCode.PRICE_TOO_HIGH,
            )
        previous = await self.recall(peer)
        if previous is not None and previous.state == "banned":
            raise PeerFault(f"banned: {previous.banned_reason}", RejectCode.BANNED)
        state = previous.joins_as() if previous is not None else "probing"
        now = self.clock()
        price_changed_at = self._rejoin_price_change(previous, request.price_per_hour, now)
        # A node rejoining in a loop gets one event row per JOIN_EVENT_WINDOW_S, not one per join.
        event = None
        if now - self._join_events.get(peer, -JOIN_EVENT_WINDOW_S) >= JOIN_EVENT_WINDOW_S:
            self._join_events[peer] = now
            event = ("join", peer, f"price ${request.price_per_hour:.2f}/h backend {request.backend}")
        with trio.CancelScope(shield=True):
            joined = await self.writer.write(
                lambda: self.store.members.upsert_node(
                    peer,
                    request.price_per_hour,
                    request.hardware,
                    request.link_bps,
                    request.backend,
                    state,
                    event=event,
                    name=request.name,
                    price_changed_at=price_changed_at,
                )
            )
            banned = self.fleet.get(peer)
            if not joined or (banned is not None and banned.state == "banned"):  # banned while this join was written
                raise PeerFault("banned", RejectCode.BANNED)
            record = self.fleet.join(peer, request, remote_ip, self.clock())
            record.heartbeat_period_s = self.heartbeat_period()
        if event is not None:  # a node rejoining in a loop gets a line per window too
            log.info("join %s state %s", peer, record.state)
        self.changed()
        return record

    def _rejoin_price_change(self, previous: NodeRecord | None, price: float, now: float) -> float | None:
        """A re-join at another price is a price change, under the one-per-interval rule of `reprice` (its clock is the
        identity's, kept across leave, re-join and restart): `now` when it is one, None when it is none, PeerFault when
        it comes too soon. Counted before the join's write, as a re-price is."""
        if previous is None or not previous.changes_price(price):
            return None
        refusal = price_change_refusal(
            price, self.max_price_per_hour, previous.price_changed_at, now, self.price_change_interval_s
        )
        if refusal is not None:
            raise PeerFault(
                f"a re-join at another price is a price change: {refusal}; join at ${previous.price_per_hour:g}/h until then",
                RejectCode.BAD_REQUEST,
            )
        previous.price_changed_at = now
        return now

    def heartbeat(self, peer: str, beat: Heartbeat, newest_version: int) -> NodeRecord:
        """A live node's news; kept in memory and flushed to the store every FLUSH_PERIOD_S. A node holds nothing the
        hub has not published (`newest_version`): a version past it is taken as the newest."""
        record = self.known(peer)
        self._seen(record)
        self.totals.heartbeats += 1
        record.version_held = min(beat.version_held, newest_version)
        record.receiving_version = beat.receiving_version
        record.chunks_received = beat.chunks_received
        record.heartbeat_period_s = self.heartbeat_period()
        return record

    def asks_for_work(self, peer: str, version_held: int) -> NodeRecord:
        """A node asking for a lease: seen now, holding at least `version_held`."""
        record = self.known(peer)
        self._seen(record)
        record.version_held = max(record.version_held, version_held)
        return record

    def submits(self, peer: str) -> NodeRecord:
        """A node handing in work (its liveness is booked with the work, `book_work`)."""
        record = self.known(peer)
        self.totals.submissions += 1
        return record

    async def reprice(self, peer: str, price: float) -> float:
        """A joined node's new price: paid for leases issued from now on (open ones keep theirs), ranked by the
        scheduler at its next period once it moved more than scheduler.price_band. Returns the seconds until
        the next change is taken; a change out of bounds or too soon is a PeerFault, counted against the peer."""
        record = self.known(peer)
        self._seen(record)
        now = self.clock()
        if price == record.price_per_hour:  # nothing changes, nor does the time the next change waits for
            last = record.price_changed_at
            return 0.0 if last is None else max(0.0, self.price_change_interval_s - (now - last))
        refusal = price_change_refusal(price, self.max_price_per_hour, record.price_changed_at, now, self.price_change_interval_s)
        if refusal is not None:
            raise PeerFault(refusal, RejectCode.BAD_REQUEST)
        # Counted before the write (the safe direction): a second change racing this one is already too soon.
        record.price_changed_at = now
        event = ("price", peer, f"${record.price_per_hour:.2f}/h -> ${price:.2f}/h")
        with trio.CancelScope(shield=True):
            changed = await self.writer.write(lambda: self.store.members.set_node_price(peer, price, now, event=event))
            if not changed or record.state == "banned":  # banned while this change was written
                raise PeerFault("banned", RejectCode.BANNED)
            record.ranked_price_per_hour = ranking_price(record.rank_price, price, self.price_band)
            record.declare_price(price, now)
        log.info("price %s: $%.4g/h (ranked at $%.4g/h)", peer, price, record.rank_price)
        return self.price_change_interval_s

    async def leave(self, peer: str) -> int:
        """A joined node stops (LEAVE_PROTOCOL): its open leases go back to the pool now, an active node leaves the
        active pool, and its chain is relinked around it, rather than after heartbeat_timeout_s of silence while the
        learner waits for its leases and its downstream for chunks. It is not activated again unless it joins again.
        It stays a member until that timeout drops it, as before, so it can still be banned: a report of a chunk it
        relayed is still judged against it (hub/distribution/broadcast.py; a relay could otherwise corrupt a chunk and
        leave before its downstream's report came). Its pay and accepted work stand. Returns how many leases went
        back. Said again before it rejoins, it changes nothing: a member repeating it cannot make the hub replan its
        chains on every request."""
        record = self.known(peer)
        if record.left_at is not None:
            return 0  # its leases went back at the first leave, and it has been given none since
        record.left_at = self.clock()
        if record.state == "active":
            await self.set_state(record, "standby", LEFT_REASON)
        released = self.departed(peer)
        self.changed()
        return released

    def heartbeat_period(self) -> float:
        """The period nodes are told to heartbeat at now (`hub.records.fleet.heartbeat_period`); the live nodes are
        counted at most once per HEARTBEAT_RECOUNT_S, so a beat costs the same in any fleet."""
        now = self.clock()
        if now - self._period_counted_at >= HEARTBEAT_RECOUNT_S:
            self._period_counted_at = now
            self._heartbeat_period_s = heartbeat_period(
                len(self.fleet.live()), self.min_heartbeat_period_s, self.heartbeats_per_s
            )
        return self._heartbeat_period_s

    def _seen(self, record: NodeRecord) -> None:
        now = self.clock()
        gap = now - record.last_seen
        timeout_s = heartbeat_timeout(record.heartbeat_period_s, self.min_heartbeat_period_s, self.heartbeat_timeout_s)
        if 0 < gap <= timeout_s:  # a longer silence was time offline
            record.online_s += gap
        record.last_seen = max(record.last_seen, now)
        self._dirty.add(record.peer_id)

    async def set_state(self, record: NodeRecord, state: NodeState, reason: str) -> None:
        """Move a node to `state` (activate, release, drop, ...); a no-op when it is there already, for a banned node
        (a ban is for good, whatever a caller decided before it awaited), and to activate a node that said it leaves
        (the scheduler may have decided before the leave came)."""
        if record.state in (state, "banned") or (state == "active" and record.left_at is not None):
            return
        previous = record.state
        kind = {
            "active": "activate",
            "standby": "release" if previous == "active" else "standby",
            "gone": "leave",
            "banned": "ban",
        }.get(state, state)
        banned_reason = reason if state == "banned" else None
        with trio.CancelScope(shield=True):
            moved = await self.writer.write(
                lambda: self.store.members.set_node_state(
                    record.peer_id, state, banned_reason, event=(kind, record.peer_id, reason)
                )
            )
            if not moved or record.state == "banned":  # banned meanwhile
                return
            self.fleet.set_state(record, state)
            if banned_reason is not None:
                record.banned_reason = banned_reason
            if state in ("gone", "banned"):
                # A released (standby) node may still finish the lease it holds: it did what it was told.
                self.departed(record.peer_id)
            if state == "banned":
                self._banned(record.peer_id)
        log.info("%s %s: %s", kind, record.peer_id, reason)
        if state in ("gone", "banned") or previous in ("gone", "banned"):
            self.changed()

    async def ban(self, record: NodeRecord, reason: str) -> None:
        """Ban a node for good (a relay caught corrupting chunks); its pay and accepted work stand."""
        await self.set_state(record, "banned", reason)

    def mark_banned(self, record: NodeRecord, reason: str) -> None:
        """Banned in the record at once, before the ban's commit (the intake's audit ban; the one other exception
        to "record after commit"): no submission, join or state change of this node may slip in meanwhile."""
        self.fleet.set_state(record, "banned")
        record.banned_reason = reason
        self._banned(record.peer_id)

    def _banned(self, peer: str) -> None:
        for listener in self.on_ban:
            listener(peer)

    async def record_refusal(self, peer: str, code: RejectCode) -> None:
        """A known node's request was refused at the protocol level: counted against it, durably. Not counted:
        "join first" (a node the hub dropped, or a hub restarted under it) and "busy" (the hub's own limits)."""
        record = self.fleet.get(peer)
        if record is None or code in (RejectCode.UNKNOWN_NODE, RejectCode.BUSY):
            return
        with trio.CancelScope(shield=True):
            await self.writer.write(self.store.members.count_refusal, peer)
            record.tallies = record.tallies + Tallies(refused=1)
            self.totals.groups = self.totals.groups + Tallies(refused=1)

    # -- what the hub measured of a node ---------------------------------------------------------

    def book_work(self, record: NodeRecord, counts: Tallies, reasons: Mapping[str, int], rate: float, measured: bool) -> None:
        """An answered lease, after its commit: the node's tallies, its refusals by reason and measured throughput, and
        whether it is too slow to activate (every group late: `NodeRecord.too_slow`)."""
        record.tallies = record.tallies + counts
        record.refused_by_reason = add_reasons(record.refused_by_reason, reasons)
        record.rollouts_per_s, record.measured = rate, measured
        if counts.accepted:
            record.late_leases, record.late_at_rate = 0, None
        elif counts.late and counts.late == counts.decided:
            record.late_leases += 1
            if record.late_leases >= LATE_LEASES_HELD:
                record.late_at_rate = rate
        self._dirty.add(record.peer_id)

    def vouch(self, record: NodeRecord, answered_at: float) -> None:
        """A passed audit, after its commit: the node's pay up to `answered_at` is vouched for (0: none newly)."""
        record.audits_passed += 1
        record.vouched_at = max(record.vouched_at or 0.0, answered_at)

    def reached(self, record: NodeRecord, answered_addr: str | None) -> None:
        """The hub's dial-back (hub/distribution/reachability.py) answered at `answered_addr` (None: it did not):
        the broadcaster's report."""
        self.fleet.reached(record, answered_addr)

    def punch_failed(self, record: NodeRecord, upstream: str) -> None:
        """The node's hole punch with `upstream` failed (the broadcaster's report): it pulls from the hub, and the
        planner separates them."""
        self.fleet.punch_failed(record, upstream)

    # -- liveness --------------------------------------------------------------------------------

    def liveness(self) -> list[tuple[str, float, float, float, bool]]:
        """What changed of the nodes' liveness since the last call, as the store's flush takes it."""
        rows = [
            (p, n.last_seen, n.online_s, n.rollouts_per_s, n.measured)
            for p in self._dirty
            if (n := self.fleet.get(p)) is not None
        ]
        self._dirty = set()
        return rows

    def forget_join_events(self, now: float) -> None:
        """Join-event times past their window go."""
        self._join_events = {p: at for p, at in self._join_events.items() if now - at < JOIN_EVENT_WINDOW_S}
