"""Relay attacks run in process against the real Broadcaster and real keepers, shared by the tests
(tests/test_broadcast.py, tests/test_transfer.py) and `bench/faults.py`: framed honest relays,
forged or rolled-back manifests, a relay that stalls after its manifest, strangers pulling from a
volunteer. Each returns a ScenarioResult: attempts made, how many were caught, how many honest
parties were wronged (false_rejections)."""

from __future__ import annotations

import logging
import time

import trio

from hub.distribution.broadcast import Broadcaster
from hub.records.fleet import Fleet, NodeRecord
from node.keeper import HUB, Upstream
from shared.crypto import Identity
from shared.messages import (
    REPORT_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    BadChunkReport,
    JoinRequest,
    Reject,
    RejectCode,
    SnapshotRequest,
    TransferAck,
)
from shared.net import connect, open_stream, request, set_handler
from shared.snapshot import CHUNK_HEADER, SIGNATURE_BYTES, ChunkAssembler, blake3_hex
from shared.transfer import TRANSFER_CAPS, commitment_payload, receive_snapshot
from shared.wire import PeerFault, read_frame, read_message, write_message
from testbed.fault_scenarios import ScenarioResult
from testbed.peers import HubPeer, NodePeer, hub_peer, node_peer, random_snapshot, scratch_dir, wait_installed

KIB = 1024


def join(fleet: Fleet, node: NodePeer, probed: bool = True) -> NodeRecord:
    """`node` joined; `probed`: and the hub's dial-back answered at its address (peers are told only such a one)."""
    request = JoinRequest(
        price_per_hour=0.5,
        hardware="test",
        link_bps=1e9,
        backend="hf",
        dtype="float32",
        model_config_hash="0" * 64,
        listen_addrs=(node.addr,),
    )
    record = fleet.join(node.peer_id, request, "127.0.0.1", time.time())
    if probed:
        record.reachability, record.answered_addr = "public", node.addr
    return record


class Hub:
    """The parts of hub/cli/run.py around a Broadcaster: bans, events, T_bcast records, heartbeats."""

    def __init__(self, peer: HubPeer, mode: str) -> None:
        self.peer = peer
        self.fleet = Fleet()
        self.banned: list[tuple[str, str]] = []
        self.events: list[tuple[str, str | None, str]] = []  # (kind, node, detail), as the hub's journal keeps them
        self.t_bcast: list[tuple[int, float]] = []
        self.broadcaster = Broadcaster(
            peer.host, self.fleet, peer.shelf, mode, None, ban=self.ban, event=self.event, record_t_bcast=self.record
        )
        set_handler(peer.host, REPORT_PROTOCOL, self.on_report, logging.getLogger("tests.hub"))

    async def on_report(self, stream) -> None:
        """What hub/service/handlers.py's guard does around the broadcaster's handler: a PeerFault becomes a Reject."""
        try:
            await self.broadcaster.on_report(stream)
        except PeerFault as exc:
            await write_message(stream, Reject(code=RejectCode(exc.code), reason=exc.reason))
            await stream.close()

    async def ban(self, record: NodeRecord, reason: str) -> None:
        record.state = "banned"
        self.banned.append((record.peer_id, reason))
        self.broadcaster.replan()

    async def event(self, kind: str, node: str | None, detail: str) -> None:
        self.events.append((kind, node, detail))

    async def record(self, version: int, seconds: float) -> None:
        self.t_bcast.append((version, seconds))

    def heartbeat(self, node: NodePeer) -> None:
        """What hub/service/handlers.py does on a heartbeat, and what the node does with the reply."""
        record = self.fleet.get(node.peer_id)
        record.version_held = node.keeper.version_held
        self.broadcaster.check_done()
        links = self.broadcaster.links(node.peer_id)
        node.keeper.update(self.peer.shelf.newest_version(), Upstream(links.upstream, links.upstream_addrs), links.downstream)

    async def heartbeats(self, nodes: list[NodePeer], period_s: float = 0.1) -> None:
        while True:
            for node in nodes:
                if self.fleet.get(node.peer_id).state != "banned":
                    self.heartbeat(node)
            await trio.sleep(period_s)


async def genuine_commitment(puller: NodePeer, relay: NodePeer, version: int, index: int) -> tuple[str, str]:
    """(blake3, commitment) the relay really sends for one chunk: what a framer could replay to the hub."""
    await connect(puller.host, relay.addr)
    stream = await open_stream(puller.host, relay.peer_id, SNAPSHOT_PROTOCOL)
    await write_message(stream, SnapshotRequest(version=version, only_chunk=index))
    await read_frame(stream, TRANSFER_CAPS)
    _, frame = await read_frame(stream, TRANSFER_CAPS)
    await stream.reset()
    return blake3_hex(frame[CHUNK_HEADER.size : -SIGNATURE_BYTES]), frame[-SIGNATURE_BYTES:].hex()


async def pull(node, sender, version, newer_than=None, signer=None, **request):
    """receive_snapshot from `sender` on a fresh stream; returns (assembler, error or None)."""
    await connect(node.host, sender.addr)
    stream = await open_stream(node.host, sender.peer_id, SNAPSHOT_PROTOCOL)
    box: list[ChunkAssembler] = []

    def assembler_for(signed, manifest):
        box.append(ChunkAssembler(manifest, scratch_dir() / "pulled.safetensors"))
        return box[0]

    try:
        await receive_snapshot(
            stream,
            SnapshotRequest(version=version, **request),
            signer or sender.peer_id,
            sender.peer_id,
            newer_than,
            assembler_for,
        )
    except Exception as exc:  # noqa: BLE001 - the tests assert on it
        await stream.reset()
        return (box[0] if box else None), exc
    return box[0], None


class StallingSource:
    """Sends the manifest, then nothing: a relay that freezes its chain."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def held_manifest(self, version, base_version=None):
        return self.inner.held_manifest(version, base_version)

    async def chunk(self, version: int, index: int, delta: bool = False) -> bytes:
        await trio.sleep_forever()


# -- the scenarios -------------------------------------------------------------------------------


async def scenario_framed_relay() -> ScenarioResult:
    """Issue 14 item 5: three false reports against an honest relay (forged evidence, its own genuine
    commitment replayed, no evidence) and one report naming a peer that is not the reporter's upstream.
    Caught: the two liars with proof banned, the unproven one acted on by nobody, the stranger refused."""
    hub_id = Identity.generate()
    async with (
        hub_peer(hub_id) as peer,
        node_peer(peer) as honest,
        node_peer(peer) as forger,
        node_peer(peer) as replayer,
        node_peer(peer) as grumbler,
    ):
        hub = Hub(peer, "chain")
        peer.shelf.add(random_snapshot(hub_id, 0, 256 * KIB, 64 * KIB))
        honest.keeper.update(0, HUB, replayer.peer_id)
        with trio.fail_after(5):
            while 0 not in honest.installed:
                await trio.sleep(0.02)
        for node in (honest, forger, replayer, grumbler):
            join(hub.fleet, node)

        async def report(reporter: NodePeer, **fields):
            hub.broadcaster.chains = [[honest.peer_id, reporter.peer_id]]
            msg = BadChunkReport(upstream=honest.peer_id, version=0, **fields)
            return await request(reporter.host, peer.peer_id, REPORT_PROTOCOL, msg, TransferAck, Reject, timeout_s=10)

        forged = await report(forger, kind="chunk", index=1, digest_hex="0" * 64, commitment_hex="ab" * 64)
        digest, commitment = await genuine_commitment(replayer, honest, 0, 2)
        replayed = await report(replayer, kind="chunk", index=2, digest_hex=digest, commitment_hex=commitment)
        hub.broadcaster.chains = [[honest.peer_id, grumbler.peer_id]]
        unproven = await report(grumbler, kind="unproven", index=0, reason="it was slow")
        unmoved = hub.broadcaster.chains[0] == [honest.peer_id, grumbler.peer_id]
        hub.broadcaster.chains = [[honest.peer_id, grumbler.peer_id]]
        stranger = BadChunkReport(upstream=grumbler.peer_id, kind="unproven", version=0)
        refused = await request(honest.host, peer.peer_id, REPORT_PROTOCOL, stranger, TransferAck, Reject, timeout_s=10)
    banned = [p for p, _ in hub.banned]
    caught = [
        not forged.ok and forger.peer_id in banned,
        not replayed.ok and replayer.peer_id in banned,
        not unproven.ok and unmoved and grumbler.peer_id not in banned,
        isinstance(refused, Reject) and refused.code == RejectCode.NOT_UPSTREAM,
    ]
    wronged = honest.peer_id in banned or hub.fleet.get(honest.peer_id).state == "banned"
    accepted = sum(1 for r in (forged, replayed, unproven) if r.ok)
    return ScenarioResult(
        "framed_relay",
        attempts=4,
        detected=sum(caught),
        accepted=accepted,
        false_rejections=int(wronged) + sum(1 for _, why in hub.banned if "false report" not in why),
    )


async def scenario_forged_manifest() -> ScenarioResult:
    """Issue 14 item 12: a relay commits to a manifest signed by another key, to an older version's
    manifest (a rollback), to the right manifest (so the report is the lie), and to a version the hub no
    longer holds; each report is judged from the relay's own commitment."""
    hub_id, relay = Identity.generate(), Identity.generate()
    async with hub_peer(hub_id) as peer:
        hub = Hub(peer, "chain")
        old, new = random_snapshot(hub_id, 1, 64 * KIB, 64 * KIB), random_snapshot(hub_id, 2, 64 * KIB, 64 * KIB)
        forged = random_snapshot(Identity.generate(), 2, 64 * KIB, 64 * KIB)
        peer.shelf.add(old)
        peer.shelf.add(new)

        def report(sent, asked: int = 2) -> BadChunkReport:
            digest = blake3_hex(sent.signed.to_bytes())
            sig = relay.sign(commitment_payload("manifest", asked, 0, digest))
            return BadChunkReport(
                upstream=relay.peer_id, kind="manifest", version=asked, digest_hex=digest, commitment_hex=sig.hex()
            )

        verdicts = [
            hub.broadcaster.judge(report(forged)),
            hub.broadcaster.judge(report(old)),
            hub.broadcaster.judge(report(new)),
            hub.broadcaster.judge(report(new, asked=9)),
        ]
    expected = ["accused", "accused", "reporter", "unknown"]
    return ScenarioResult(
        "forged_manifest",
        attempts=4,
        detected=sum(v == e for v, e in zip(verdicts, expected)),
        false_rejections=sum(v != e for v, e in zip(verdicts, expected)),
    )


async def scenario_stalling_relay() -> ScenarioResult:
    """Issue 14 item 7: the sink's upstream sends a manifest, then nothing. Caught: the sink leaves it
    within its stall deadline, reports it (unproven: no one is banned on its word) and installs the
    snapshot bit-exact from the hub."""
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 3, 256 * KIB, 64 * KIB)
    async with hub_peer(hub_id) as hub:
        hub.shelf.add(snapshot)
        async with (
            hub_peer(Identity.generate(), source=StallingSource(hub.shelf)) as staller,
            node_peer(hub, stall_s=1.0) as sink,
        ):
            sink.keeper.update(3, Upstream(staller.peer_id, (staller.addr,)), None)
            await wait_installed([sink], 3, timeout_s=15)
    reported = bool(hub.reports) and all((r.upstream, r.kind) == (staller.peer_id, "unproven") for _, r in hub.reports)
    caught = sink.installed.get(3) == snapshot.path.read_bytes() and reported and sink.keeper.upstream_failures >= 1
    return ScenarioResult("stalling_relay", attempts=1, detected=int(caught))


async def scenario_serving_strangers() -> ScenarioResult:
    """Issue 14 item 11: a stranger asks a volunteer for the snapshot it holds. Caught: refused
    (NOT_UPSTREAM) before one manifest byte, within 10 s, while the successor the hub named still
    pulls it whole."""
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 1, 256 * KIB, 64 * KIB)
    async with hub_peer(hub_id) as hub:
        hub.shelf.add(snapshot)
        async with node_peer(hub) as relay, node_peer(hub) as stranger, node_peer(hub) as successor:
            relay.keeper.update(1, HUB, successor.peer_id)
            await wait_installed([relay], 1, timeout_s=5)
            started = time.monotonic()
            await connect(stranger.host, relay.addr)
            stream = await open_stream(stranger.host, relay.peer_id, SNAPSHOT_PROTOCOL)
            await write_message(stream, SnapshotRequest(version=1))
            reply = await read_message(stream, Reject)
            refused = reply.code == RejectCode.NOT_UPSTREAM and time.monotonic() - started < 10
            assembler, error = await pull(successor, relay, 1, signer=hub_id.peer_id)
    served = error is None and assembler.complete
    return ScenarioResult(
        "serving_strangers", attempts=1, detected=int(refused), accepted=int(not refused), false_rejections=int(not served)
    )


RELAY_SCENARIOS = {
    "framed_relay": scenario_framed_relay,
    "forged_manifest": scenario_forged_manifest,
    "stalling_relay": scenario_stalling_relay,
    "serving_strangers": scenario_serving_strangers,
}
