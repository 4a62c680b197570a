"""The hub's broadcaster: keeps the forwarding chains, starts each snapshot down them, measures T_bcast,
moves a relay that stalls or crawls to its chain's tail, and judges reports of bad relays by the relays' own
signed commitments (docs/DESIGN.md §7-8).

Nodes pull from their chain predecessor (the hub for a chain head) over the snapshot
protocol; the broadcaster only tells each node whom to pull from (in heartbeat replies) and
nudges chain heads with a RelayOffer when a snapshot is published, so no heartbeat period
is lost. In star mode every node pulls from the hub.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio
from libp2p.abc import IHost, INetStream

from hub.distribution.reachability import PROBE_VERDICT_S, PROBES_AT_ONCE, DialBackQueue, dial_back, probe_targets
from hub.method.chains import (
    SLOW_RELAY_FRACTION,
    join_chains,
    link_kind,
    num_chains,
    proven_first,
    relay_too_slow,
    relink_after_leave,
    separate_nated,
)
from hub.records.fleet import Fleet, NodeRecord
from hub.records.measurements import Measurements
from hub.records.snapshots import SnapshotShelf
from shared.crypto import public_key_from_peer_id
from shared.messages import RELAY_PROTOCOL, BadChunkReport, RejectCode, RelayOffer, TransferAck, short_id
from shared.net import RateLimiter, open_stream, remote_peer_id
from shared.transfer import STALL_S, Writer, commitment_holds
from shared.wire import PeerFault, WritableStream, read_message, write_message

log = logging.getLogger("echo2.hub.broadcast")


# How often waiting dial-backs are looked at again when nothing woke the dispatcher.
PROBE_DISPATCH_S = 0.5
# Membership changes are replanned at most once per this long: join/leave churn costs one relink of the chains per
# period, however many changes it covers.
REPLAN_PERIOD_S = 1.0
# The `chains:` line is logged at most once per this long; it says how many replans changed the chains since the last.
CHAINS_LOG_WINDOW_S = 60.0
# Broadcasts timed at once; an older one still unfinished when a newer one would exceed this is dropped
# untimed (its receivers are far behind; the newer ones will be timed).
PENDING_BROADCASTS = 8
# A successor's report of its chunks may be this many of its heartbeat periods old: one period, and one beat late (as
# much as its heartbeat timeout forgives). Its relay's pace is judged by what it reported, never by that lag.
REPORT_LAG_PERIODS = 2


@dataclass(frozen=True)
class ChainLinks:
    """Where one node pulls snapshots from and who pulls from it (hub.method.chains.link_kind: how)."""

    upstream: str | None
    upstream_addrs: tuple[str, ...]
    downstream: str | None
    chain: int | None
    chain_position: int | None
    kind: str = "hub"
    downstream_addrs: tuple[str, ...] = ()  # dial these first: the downstream cannot dial this node


@dataclass(frozen=True)
class PaceWindow:
    """Since when the hub times a relay's pace to its successor: the relay, the version, the successor's chunks then."""

    upstream: str
    version: int
    chunks: int
    since: float  # trio's clock


@dataclass
class Broadcast:
    version: int
    published_at: float
    receivers: frozenset[str]
    done_at: float | None = None
    # receiver -> when the hub first saw it holding this version (or a newer one): its heartbeat or a lease
    # request told the fleet record, and the next heartbeat of any node checks. A lease request is when the
    # node starts to work with the version, which is what the capacity model needs.
    installed_at: dict[str, float] = field(default_factory=dict)
    # (rollouts/s, seconds from the publish) of each node of the active pool, once the broadcast is done
    # (hub.method.capacity.Arrival).
    installs: tuple[tuple[float, float], ...] = ()

    @property
    def seconds(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.published_at

    @property
    def arrive_s(self) -> float | None:
        """When the active pool's throughput got it, on average; None if no active node did."""
        total = math.fsum(w for w, _ in self.installs)
        return math.fsum(w * s for w, s in self.installs) / total if total > 0 else None


class _Through:
    """A stream whose writes go through a shared limiter."""

    def __init__(self, limiter: RateLimiter, stream: WritableStream) -> None:
        self.limiter = limiter
        self.stream = stream

    async def write(self, data: bytes) -> None:
        await self.limiter.write(self.stream, data)


class _LinkThenUplink:
    """One stream: at most Bw on its own connection, and a share of the hub's uplink B0."""

    def __init__(self, link: RateLimiter, uplink: RateLimiter) -> None:
        self.link = link
        self.uplink = uplink

    async def write(self, stream: WritableStream, data: bytes) -> None:
        await self.link.write(_Through(self.uplink, stream), data)


class HubUplink:
    """Link emulation for what the hub serves: B0 shared by all its streams, each stream at most Bw.

    B0 alone models a hub whose uplink is the bottleneck (star mode's N * M / B0); Bw alone,
    a hub no faster than one node link. With B0 > Bw both apply, so that N_ch = B0 / Bw chain
    heads each get Bw, as docs/DESIGN.md §7 assumes. Both None: no emulation.
    """

    def __init__(self, hub_bps: float | None, link_bps: float | None) -> None:
        self.link_bps = link_bps
        total = hub_bps if hub_bps is not None else link_bps
        self.uplink = RateLimiter(total) if total is not None else None
        self.per_stream = link_bps is not None and total is not None and link_bps < total

    def for_stream(self) -> Writer | None:
        """The writer one served stream goes through (None: unlimited)."""
        if self.per_stream and self.link_bps is not None and self.uplink is not None:
            return _LinkThenUplink(RateLimiter(self.link_bps), self.uplink)
        return self.uplink


class ReachabilityReports(Protocol):
    """Where the broadcaster reports what it found of a node's reachability: the owner of the node records
    (hub/service/membership.py); the broadcaster itself writes no record."""

    def reached(self, record: NodeRecord, answered_addr: str | None) -> None: ...

    def punch_failed(self, record: NodeRecord, upstream: str) -> None: ...


class Broadcaster:
    def __init__(
        self,
        host: IHost,
        fleet: Fleet,
        shelf: SnapshotShelf,
        mode: str,
        hub_uplink_bps: float | None,
        ban: Callable[[NodeRecord, str], Awaitable[None]],
        event: Callable[[str, str | None, str], Awaitable[None]],
        record_t_bcast: Callable[[int, float], Awaitable[None]],
        reports: ReachabilityReports | None = None,
        measurements: Measurements | None = None,
    ) -> None:
        """`reports`: the owner of `fleet`'s records (None: a fleet with no other owner, as in the test bed's relay
        scenarios, written through its own helpers). `measurements`: where each broadcast on every receiver is
        measured (T_bcast, arrival, installs; None: kept here only)."""
        self.host = host
        self.reports: ReachabilityReports = reports if reports is not None else fleet
        self.measurements = measurements
        self.hub_peer_id = host.get_id().to_base58()
        self.fleet = fleet
        self.shelf = shelf
        self.mode = mode
        self.hub_uplink_bps = hub_uplink_bps
        self.ban = ban
        self.event = event
        self.record_t_bcast = record_t_bcast
        self.chains: list[list[str]] = []
        # node -> ((receiving version, chunks received), since when): progress of each node, from heartbeats.
        self._progress: dict[str, tuple[tuple[int | None, int], float]] = {}
        # node -> the version for which it last got its upstream moved.
        self._demoted_for: dict[str, int] = {}
        # node -> since when its upstream's pace to it is timed (_check_pace).
        self._paces: dict[str, PaceWindow] = {}
        # node -> the upstreams it had that said they leave since (_remember_left_relays).
        self._left_upstream: dict[str, set[str]] = {}
        # node -> the downstream its last heartbeat reply named: a hole punch is planned only once its upstream
        # was told (a punch the upstream does not expect is refused, and a failed punch separates the pair).
        self._told_downstream: dict[str, str | None] = {}
        # Broadcasts not yet on every receiver, oldest first. Several at once: a learner that publishes
        # faster than the chain's tail installs must still get each version timed.
        self.pending: list[Broadcast] = []
        self.last_done: Broadcast | None = None
        self._nursery: trio.Nursery | None = None
        self._probing: set[str] = set()  # dial-backs running now
        self._probe_queue = DialBackQueue()
        self._probe_wake = trio.Event()
        self._replan_wanted = trio.Event()
        self._chains_logged_at = -math.inf  # trio's clock
        self._replans_unlogged = 0  # replans that changed the chains since the last `chains:` line

    # -- chain membership ---------------------------------------------------------------

    def receivers(self) -> list[NodeRecord]:
        return [n for n in self.fleet.live() if n.state in ("probing", "active", "standby") and n.left_at is None]

    def _max_chains(self, members: list[NodeRecord]) -> int:
        if self.mode == "star":
            return max(1, len(members))
        if not members or self.hub_uplink_bps is None:
            return 1  # B0 unknown: assume the hub uplink is no faster than a node's link
        return num_chains(self.hub_uplink_bps, min(n.link_bps for n in members), len(members))

    def replan(self) -> None:
        """Bring the chains in line with the fleet: cut out who left, append who joined."""
        members = {n.peer_id: n for n in self.receivers()}
        self._remember_left_relays(members)
        chains = self._joined(self._without_gone(self.chains, members), members)
        chains = proven_first(chains, {p for p, n in members.items() if n.measured})
        self._forget_gone(members)
        chains = self._separate_failed_punches(chains, members)
        self._queue_probes(members)
        if chains != self.chains:
            self.chains = chains
            self._replans_unlogged += 1
            self._log_chains()

    def replan_soon(self) -> None:
        """Who may work changed: the chains follow within REPLAN_PERIOD_S, in one replan for every change meanwhile
        (`_coalesce_replans`)."""
        self._replan_wanted.set()

    async def _coalesce_replans(self) -> None:
        """Replan when asked, at most once per REPLAN_PERIOD_S; log the chains the last replans left once their
        window is over, if no later replan did."""
        while True:
            due = self._chains_logged_at + CHAINS_LOG_WINDOW_S if self._replans_unlogged else math.inf
            with trio.move_on_at(due):
                await self._replan_wanted.wait()
            if not self._replan_wanted.is_set():
                self._log_chains()
                continue
            self._replan_wanted = trio.Event()
            self.replan()
            await trio.sleep(REPLAN_PERIOD_S)

    def _log_chains(self) -> None:
        """The `chains:` line, at most once per CHAINS_LOG_WINDOW_S, with how many replans changed them since."""
        now = trio.current_time()
        if not self._replans_unlogged or now - self._chains_logged_at < CHAINS_LOG_WINDOW_S:
            return
        log.info(
            "chains: %s (%d replans since the last such line)", [[p[-6:] for p in c] for c in self.chains], self._replans_unlogged
        )
        self._chains_logged_at, self._replans_unlogged = now, 0

    @staticmethod
    def _without_gone(chains: list[list[str]], members: dict[str, NodeRecord]) -> list[list[str]]:
        """The chains relinked around every node no longer among `members`."""
        for gone in [p for chain in chains for p in chain if p not in members]:
            chains = relink_after_leave(chains, gone)
        return chains

    def _joined(self, chains: list[list[str]], members: dict[str, NodeRecord]) -> list[list[str]]:
        """The chains with every member not yet in one appended, fastest link first."""
        in_chains = {p for chain in chains for p in chain}
        limit = self._max_chains(list(members.values()))
        for peer in sorted(members, key=lambda p: (-members[p].link_bps, p)):
            if peer not in in_chains:
                chains = join_chains(chains, peer, limit)
        return chains

    def _remember_left_relays(self, members: dict[str, NodeRecord]) -> None:
        """Before the chains are relinked: the downstream of each relay that said it leaves may still report a chunk
        that relay sent, until the relay is dropped (gone or banned) or joins again; a downstream dropped is forgotten."""
        for chain in self.chains:
            for up, down in zip(chain, chain[1:], strict=False):
                if up not in members and down in members and self.fleet.is_member(up):
                    self._left_upstream.setdefault(down, set()).add(up)
        kept = {
            down: {up for up in ups if up not in members and self.fleet.is_member(up)}
            for down, ups in self._left_upstream.items()
            if down in members
        }
        self._left_upstream = {down: ups for down, ups in kept.items() if ups}

    def _forget_gone(self, members: dict[str, NodeRecord]) -> None:
        """Drop the progress, demotions and queued dial-backs of nodes no longer among `members`."""
        for peer in set(self._progress) - set(members):
            self._progress.pop(peer, None)
            self._demoted_for.pop(peer, None)
        for peer in set(self._paces) - set(members):
            del self._paces[peer]
        for peer in set(self._told_downstream) - set(members):
            del self._told_downstream[peer]
        self._probe_queue.retain(members)

    @staticmethod
    def _separate_failed_punches(chains: list[list[str]], members: dict[str, NodeRecord]) -> list[list[str]]:
        """Hole punches are tried first; a chain where one failed gets dialable nodes between its NATed ones."""
        reach = {p: n.reachability for p, n in members.items()}
        return [
            separate_nated(chain, reach) if any(members[p].punch_failed_with for p in chain if p in members) else chain
            for chain in chains
        ]

    def _queue_probes(self, members: dict[str, NodeRecord]) -> None:
        """Queue a dial-back for every member whose reachability is still unknown and not yet probed."""
        for peer, record in members.items():
            if record.reachability == "unknown" and peer not in self._probing and peer not in self._probe_queue:
                self._probe_queue.offer(peer, record.remote_ip, record.audits_passed)
                self._probe_wake.set()

    def _reach(self, peer: str) -> str:
        record = self.fleet.get(peer)
        return record.reachability if record else "unknown"

    def _kind(self, upstream: str | None, peer: str, told: bool = True) -> str:
        """hub.method.chains.link_kind, and a pull from the hub after a hole punch between the two failed or, with
        `told`, while the upstream has not yet been told (by a heartbeat reply) that `peer` is its downstream."""
        kind = link_kind(self._reach(upstream) if upstream else None, self._reach(peer))
        if kind != "holepunch":
            return kind
        record = self.fleet.get(peer)
        if record is not None and record.punch_failed_with == upstream:
            return "hub"
        if told and upstream is not None and self._told_downstream.get(upstream) != peer:
            return "hub"
        return kind

    @staticmethod
    def _dial_addrs(record: NodeRecord) -> tuple[str, ...]:
        """Where peers dial a node: the address its dial-back answered at, and none before one did (a listen
        address it merely declares could be anyone's: volunteers would dial it from inside their LANs)."""
        return (record.answered_addr,) if record.answered_addr else ()

    def planned_punch(self, initiator: str, target: str) -> bool:
        """Whether `initiator` is to hole-punch to `target`, its NATed upstream (the hub's relay carries only that)."""
        links = self.links(initiator)
        return links.kind == "holepunch" and links.upstream == target

    def link_kinds(self) -> dict[str, str]:
        """How every chain member gets its snapshots, in one pass over the chains (for the status board)."""
        return {peer: self._kind(chain[i - 1] if i else None, peer) for chain in self.chains for i, peer in enumerate(chain)}

    def punch_failed(self, peer: str, upstream: str) -> None:
        """`peer` says its hole punch with `upstream` failed: believed only of the link planned as a punch;
        the pair is separated at once."""
        record = self.fleet.get(peer)
        links = self.links(peer)
        if record is None or links.kind != "holepunch" or links.upstream != upstream:
            return
        self.reports.punch_failed(record, upstream)
        self.replan()

    def heartbeat_links(self, peer: str) -> ChainLinks:
        """`links(peer)` for its heartbeat reply, remembering the downstream the reply names."""
        links = self.links(peer)
        self._told_downstream[peer] = links.downstream
        return links

    def links(self, peer: str) -> ChainLinks:
        for index, chain in enumerate(self.chains):
            if peer in chain:
                position = chain.index(peer)
                upstream = chain[position - 1] if position > 0 else None
                kind = self._kind(upstream, peer)
                if kind == "hub":
                    upstream = None  # heads its chain, or sits behind a NATed node it cannot reach
                record = self.fleet.get(upstream) if upstream else None
                addrs = self._dial_addrs(record) if record and kind == "direct" else ()
                downstream = chain[position + 1] if position + 1 < len(chain) else None
                down = self.fleet.get(downstream) if downstream else None
                # Planned, told or not: the upstream must hear of its downstream before the downstream punches.
                down_kind = self._kind(peer, downstream, told=False) if downstream else None
                pushed = down is not None and down_kind == "pushed"
                if down is not None and down_kind == "hub":
                    downstream = None  # it pulls from the hub, not from us
                push_to = self._dial_addrs(down) if pushed and down is not None else ()
                return ChainLinks(upstream, addrs, downstream, index, position, kind, push_to)
        return ChainLinks(None, (), None, None, None)

    # -- broadcasts -----------------------------------------------------------------------

    async def publish(self, version: int) -> None:
        """A snapshot is on the shelf: start the clock and nudge every chain head."""
        self.replan()
        receivers = frozenset(n.peer_id for n in self.receivers())
        full, delta = self.shelf.get(version), self.shelf.delta(version)
        size = f"{full.manifest.total_bytes / 1e6:.3g} MB" if full else "?"
        if full and delta:
            size += f", delta {delta.manifest.total_bytes / 1e6:.3g} MB ({delta.manifest.total_bytes / full.manifest.total_bytes:.1%})"
        await self.event(
            "snapshot", None, f"v{version} ({size}) published to {len(receivers)} nodes in {len(self.chains)} chains"
        )
        if not receivers:
            # Nobody to time: a T_bcast here would measure how long the first node took to join.
            return
        self.pending = [*self.pending, Broadcast(version, trio.current_time(), receivers)][-PENDING_BROADCASTS:]
        for chain in self.chains:
            self._spawn(self._nudge, chain[0], version)
        self.check_done()

    async def _nudge(self, peer: str, version: int) -> None:
        try:
            with trio.fail_after(5):
                stream = await open_stream(self.host, peer, RELAY_PROTOCOL)
                await write_message(stream, RelayOffer(version=version))
                await stream.close()
        except Exception as exc:  # noqa: BLE001 - the heartbeat reply tells it anyway
            log.debug("nudge of %s failed: %r", peer[-8:], exc)

    def check_done(self) -> None:
        """Called on every heartbeat: a broadcast ends when every receiver still around holds its version
        (or a newer one: a node that skipped to the next version had this one's bytes on the way)."""
        now = trio.current_time()
        for b in list(self.pending):
            waiting = []
            for p in b.receivers:
                n = self.fleet.get(p)
                if n is None or n.state in ("banned", "gone") or n.left_at is not None:
                    continue
                if n.version_held < b.version:
                    waiting.append(p)
                else:
                    b.installed_at.setdefault(p, now)
            if not waiting:
                b.done_at = now
                b.installs = self._active_installs(b)
                self.pending.remove(b)
                if self.last_done is None or b.version > self.last_done.version:
                    self.last_done = b
                    if self.measurements is not None and b.seconds is not None:
                        self.measurements.broadcast_done(b.seconds, b.arrive_s, b.installs)
                log.info("v%d reached every node in %.2fs", b.version, b.seconds)
                self._spawn(self.record_t_bcast, b.version, b.seconds)
        if self.pending:
            self._check_progress(self.pending[-1], now)

    def _check_progress(self, b: Broadcast, now: float) -> None:
        """Re-link around a relay whose successor gets nothing, or far too little, while the relay says it is ahead.

        Judged from heartbeats, by what each node says of itself: a relay that claims chunks it does not
        serve, or serves them at a crawl, is moved to the end of its chain. A successor can get its own upstream
        moved at most once per version, so no node climbs a chain faster than one place per published version; and
        only a node the hub measured (it answered work) can get a measured relay moved: a throwaway identity that
        never pulls looks like a relay's stalled successor, and 64 of them pushed the one working node to their
        tail, a 20 s stall behind each of them a version (issue 65)."""
        held = self.shelf.held_manifest(b.version)
        if held is None:
            return
        chunk_bytes = held[1].chunk_size
        hub_bps = self._hub_pace_bps(b)
        # Taken before any move: a relay moved to its chain's tail leaves the other pairs as they were.
        for up, down in [pair for chain in self.chains for pair in zip(chain, chain[1:])]:
            u, d = self.fleet.get(up), self.fleet.get(down)
            if u is None or d is None or d.version_held >= b.version or (u.measured and not d.measured):
                continue
            self._check_pace(b, u, d, now, chunk_bytes, hub_bps)
            self._check_stall(b, u, d, now, chunk_bytes)

    def _check_stall(self, b: Broadcast, u: NodeRecord, d: NodeRecord, now: float, chunk_bytes: int) -> None:
        """Demote `u` when its successor `d` made no progress on `b` for STALL_S plus two chunks' time while `u` is ahead."""
        mark = (d.receiving_version, d.chunks_received)
        seen = self._progress.get(d.peer_id)
        if seen is None or seen[0] != mark:
            self._progress[d.peer_id] = (mark, now)
            return
        ahead = u.version_held >= b.version or (u.receiving_version == b.version and u.chunks_received > d.chunks_received)
        window = STALL_S + 2 * chunk_bytes / max(1.0, min(u.link_bps, d.link_bps))
        if ahead and now - seen[1] > window and self._demoted_for.get(d.peer_id) != b.version:
            self._progress[d.peer_id] = (mark, now)
            self._demote_for(
                d.peer_id, b.version, u.peer_id, f"{short_id(d.peer_id)} got nothing from it for {now - seen[1]:.0f}s"
            )

    def _check_pace(
        self, b: Broadcast, u: NodeRecord, d: NodeRecord, now: float, chunk_bytes: int, hub_bps: float | None
    ) -> None:
        """Demote `u` when it holds `b` whole but sends it to `d` too slowly (hub.method.chains.relay_too_slow against
        their declared links and the hub's own pace), timed from `d`'s reports since `u` first held it while `d` pulled
        it from `u`. A successor that pulls elsewhere, or starts over, starts a new window."""
        window = self._paces.get(d.peer_id)
        timed = u.version_held >= b.version and d.receiving_version == b.version and self._kind(u.peer_id, d.peer_id) != "hub"
        if not timed:
            self._paces.pop(d.peer_id, None)
            return
        if window is None or (window.upstream, window.version) != (u.peer_id, b.version) or d.chunks_received < window.chunks:
            self._paces[d.peer_id] = PaceWindow(u.peer_id, b.version, d.chunks_received, now)
            return
        if hub_bps is None or self._demoted_for.get(d.peer_id) == b.version:
            return
        delivered, elapsed = (d.chunks_received - window.chunks) * chunk_bytes, now - window.since
        lag_s, link_bps = REPORT_LAG_PERIODS * d.heartbeat_period_s, min(u.link_bps, d.link_bps)
        if relay_too_slow(delivered, elapsed, lag_s, link_bps, hub_bps, chunk_bytes):
            del self._paces[d.peer_id]
            bound = f"{SLOW_RELAY_FRACTION:.0%} of {min(link_bps, hub_bps) / 1e6:.3g} MB/s (declared link, hub's pace)"
            detail = f"{short_id(d.peer_id)} got {delivered / 1e6:.3g} MB from it in {elapsed:.0f}s, below {bound}"
            self._demote_for(d.peer_id, b.version, u.peer_id, detail)

    def _hub_pace_bps(self, b: Broadcast) -> float | None:
        """The hub's own pace for `b`: its smaller transfer (a delta, when it has one) over the seconds from the publish
        to the first install; None before any receiver installed it."""
        first_s = min(b.installed_at.values(), default=b.published_at) - b.published_at
        sizes = [s.manifest.total_bytes for s in (self.shelf.get(b.version), self.shelf.delta(b.version)) if s is not None]
        return min(sizes) / first_s if sizes and first_s > 0 else None

    def _demote_for(self, down: str, version: int, up: str, detail: str) -> None:
        """`down` gets its upstream `up` moved to its chain's tail, once per `version`; the journal counts it against `up`."""
        self._demoted_for[down] = version
        self.demote(up)
        self._spawn(self.event, "relay_stalled", up, detail)

    async def _dispatch_probes(self) -> None:
        """Start dial-backs as DialBackQueue allows, at most PROBES_AT_ONCE at a time."""
        while True:
            now = trio.current_time()
            while len(self._probing) < PROBES_AT_ONCE and (taken := self._probe_queue.take(now)) is not None:
                peer, key = taken
                record = self.fleet.get(peer)
                if record is None or record.reachability != "unknown":
                    self._probe_queue.done(key)
                    continue
                self._probing.add(peer)
                self._spawn(self._probe, record, key)
            self._probe_queue.prune(now)
            self._probe_wake = trio.Event()
            with trio.move_on_after(PROBE_DISPATCH_S):  # a rested address or a freed slot: look again
                await self._probe_wake.wait()

    async def _probe(self, record: NodeRecord, key: str) -> None:
        """Dial the node back (hub/distribution/reachability.py), then plan its links by the answer."""
        probed = (record.listen_addrs, record.remote_ip)
        addrs = probe_targets(record.peer_id, *probed)
        started, answered = trio.current_time(), None
        try:
            with trio.move_on_after(PROBE_VERDICT_S):
                answered = await dial_back(record.peer_id, addrs)
        except Exception as exc:  # noqa: BLE001 - our throwaway host failing is no reason to stop the hub
            log.warning("dial-back of %s failed: %r", record.peer_id[-8:], exc)
            answered = None
        finally:
            self._probing.discard(record.peer_id)
            self._probe_queue.done(key)
            self._probe_wake.set()
        if answered is None:
            # A refused port and a silent one get their verdict at the same moment: no port-scan oracle.
            await trio.sleep_until(started + PROBE_VERDICT_S)
        if (record.listen_addrs, record.remote_ip) != probed:
            self.replan()  # it rejoined from elsewhere meanwhile: that address gets its own probe
            return
        self.reports.reached(record, answered)
        await self.event("reachability", record.peer_id, f"{record.reachability} ({', '.join(addrs) or 'no address'})")
        self.replan()

    def _active_installs(self, b: Broadcast) -> tuple[tuple[float, float], ...]:
        """(rollouts/s, seconds from the publish) of each active node that installed `b`."""
        return tuple(
            (n.rollouts_per_s, at - b.published_at)
            for p, at in b.installed_at.items()
            if (n := self.fleet.get(p)) is not None and n.state == "active" and n.rollouts_per_s > 0
        )

    def last_t_bcast_s(self) -> float | None:
        return None if self.last_done is None else self.last_done.seconds

    def last_arrival_s(self) -> float | None:
        return None if self.last_done is None else self.last_done.arrive_s

    def last_installs(self) -> tuple[tuple[float, float], ...]:
        return () if self.last_done is None else self.last_done.installs

    # -- judging reports of bad relays --------------------------------------------------------

    async def on_report(self, stream: INetStream) -> None:
        """REPORT_PROTOCOL: a node reports its upstream. With the upstream's signed commitment, the report
        is proof either way: the upstream committed to bytes that fail the manifest the hub signed (it is
        banned), or to the right bytes (the reporter lied, and is banned). Without one, nothing can be
        checked: the upstream is only moved to the end of its chain, where it feeds nobody.
        """
        reporter = remote_peer_id(stream)
        report = await read_message(stream, BadChunkReport)
        accused = self.fleet.get(report.upstream)
        upstreams = {self.links(reporter).upstream, *self._left_upstream.get(reporter, ())}
        if report.upstream not in upstreams or accused is None:
            raise PeerFault("that peer is not your upstream", RejectCode.NOT_UPSTREAM)
        verdict = self.judge(report)
        if verdict == "accused":
            await self.ban(accused, f"committed to a corrupt {report.kind} {report.index} of v{report.version}")
        elif verdict == "reporter" and (rec := self.fleet.get(reporter)) is not None:
            await self.ban(rec, f"false report against {report.upstream[-8:]}: its commitment is to the right bytes")
        elif verdict == "unproven":
            # Nothing to check, so nothing is done on the reporter's word alone (it could be used to move
            # honest relays around); a relay that really stalls is seen in heartbeats (_check_progress).
            await self.event("report_unproven", reporter, f"{short_id(report.upstream)}: {report.reason}")
        else:
            await self.event("report_unchecked", reporter, f"v{report.version} is no longer held: cannot check")
        await write_message(stream, TransferAck(version=report.version, chunks=0, ok=verdict == "accused"))
        await stream.close()

    def judge(self, report: BadChunkReport) -> str:
        """Whom a report proves a liar: "accused", "reporter", "unproven" (no commitment), or "unknown"."""
        if report.kind == "unproven" or report.commitment_hex is None or report.digest_hex is None:
            return "unproven"
        signature = bytes.fromhex(report.commitment_hex)
        try:
            key = public_key_from_peer_id(report.upstream)
        except ValueError:
            return "reporter"  # the reporter named a peer id no commitment can be checked against
        if not commitment_holds(key, report.kind, report.version, report.index, report.digest_hex, signature):
            return "reporter"  # evidence the accused never signed: fabricated
        if self.shelf.get(report.version) is None:
            return "unknown"
        delta = report.kind.startswith("delta-")
        snapshot = self.shelf.delta(report.version) if delta else self.shelf.get(report.version)
        if snapshot is None:
            # No delta of it held: a hub that restarted republishes its newest version without the delta its
            # relays may still serve. Nothing to check the commitment against.
            return "unknown"
        manifest = snapshot.manifest
        if report.kind in ("manifest", "delta-manifest"):
            truth = self.shelf.manifest_digest(report.version, delta)
        elif report.index < manifest.chunk_count:
            truth = manifest.chunk_hashes[report.index]
        else:
            truth = None  # a chunk index the snapshot does not have: whatever was committed to is wrong
        return "reporter" if report.digest_hex == truth else "accused"

    def demote(self, peer: str) -> None:
        """Move `peer` to the end of its chain: an unreliable relay then feeds nobody."""
        for chain in self.chains:
            if peer in chain and chain[-1] != peer:
                chain.remove(peer)
                chain.append(peer)
                log.info("moved %s to the end of its chain", peer[-8:])

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[name-defined]
        """Start with `await nursery.start(broadcaster.run)`: publish() needs the nursery this opens."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._dispatch_probes)
            nursery.start_soon(self._coalesce_replans)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        """Background work in the broadcaster's nursery; none once it stopped (heartbeats handled while the
        hub shuts down still call check_done)."""
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)
