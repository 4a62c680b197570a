"""The snapshot pull protocol and the node's keeper over real libp2p hosts on loopback, in one process:
chains of relays, resume after an upstream dies, re-link away from a stalled upstream, tampered chunks,
foreign and stale manifests, and the emulated link rate of a served stream."""

from __future__ import annotations

import logging
import time

import pytest
import trio
import trio.testing

from hub.distribution.broadcast import HubUplink
from hub.records.snapshots import SnapshotShelf
from node.keeper import HUB, Upstream
from shared.crypto import Identity
from shared.messages import (
    CHUNK_FRAME,
    MANIFEST_FRAME,
    RELAY_PROTOCOL,
    SNAPSHOT_PROTOCOL,
    RelayOffer,
    SnapshotRequest,
    TransferAck,
)
from shared.net import RateLimiter, connect, open_stream, running_host, set_handler
from shared.snapshot import (
    MAX_CHUNK_BYTES,
    SNAPSHOT_FORMAT_VERSION,
    BadSignature,
    ChunkAssembler,
    Manifest,
    StaleSnapshot,
    blake3_hex,
    encode_chunk,
    sign_manifest,
)
from shared.transfer import ChunkRejected, commitment_payload, receive_snapshot
from shared.wire import encode_frame, read_message, write_frame, write_message
from testbed.peers import FlippingKeeper, hub_peer, node_peer, random_snapshot, scratch_dir, wait_installed
from testbed.relay_scenarios import pull, scenario_serving_strangers, scenario_stalling_relay

KIB = 1024
MIB = 1024 * KIB


def commit(identity: Identity, kind: str, version: int, index: int, data: bytes) -> bytes:
    """The commitment an honest sender appends to a frame (shared/transfer.py)."""
    return identity.sign(commitment_payload(kind, version, index, blake3_hex(data)))


class FlippingSource:
    """Serves a held snapshot but flips one byte of chunk `bad_index` (a lying hub or relay)."""

    def __init__(self, inner, bad_index: int) -> None:
        self.inner = inner
        self.bad_index = bad_index

    def held_manifest(self, version, base_version=None):
        return self.inner.held_manifest(version, base_version)

    async def chunk(self, version: int, index: int, delta: bool = False) -> bytes:
        data = await self.inner.chunk(version, index, delta)
        if index == self.bad_index:
            data = bytes([data[0] ^ 0x01]) + data[1:]
        return data


@pytest.mark.timing
@pytest.mark.trio
async def test_chain_of_relays_delivers_bit_exact_and_relays_while_receiving():
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 3, 2 * MIB, 64 * KIB)
    rate = 4e6  # bytes/s on every link: a hop of 2 MiB takes about 0.5 s
    async with hub_peer(hub_id, HubUplink(None, rate)) as hub:
        hub.shelf.add(snapshot)
        async with (
            node_peer(hub, RateLimiter(rate)) as a,
            node_peer(hub, RateLimiter(rate)) as b,
            node_peer(hub, RateLimiter(rate)) as sink,
        ):
            a.keeper.update(-1, HUB, b.peer_id)
            b.keeper.update(-1, a.upstream, sink.peer_id)
            sink.keeper.update(-1, b.upstream, None)
            await trio.sleep(0.3)  # each node dials its upstream on being linked; let that finish
            started = time.monotonic()
            a.keeper.announce(3)  # the hub's nudge to the chain head; the rest learn from their upstream
            await wait_installed([a, b, sink], 3, timeout_s=20)
            elapsed = time.monotonic() - started
    for node in (a, b, sink):
        assert node.installed[3] == snapshot.path.read_bytes()
        assert node.keeper.version_held == 3 and node.keeper.transfer is None
    # Pipelined: the sink had its first chunk long before the head had its last, and the whole chain
    # took less than three store-and-forward hops would (3 * 0.52 s), even on a busy machine.
    assert sink.first_chunk_at < a.installed_at[3] - 0.2
    assert elapsed < 2.5 * snapshot.manifest.total_bytes / rate
    assert [peer for peer, _ in hub.requests] == [a.peer_id]


@pytest.mark.trio
async def test_resume_from_first_missing_chunk_after_upstream_dies():
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 1, 2 * MIB, 64 * KIB)
    total = snapshot.manifest.chunk_count
    async with hub_peer(hub_id, HubUplink(None, 4e6)) as hub:
        hub.shelf.add(snapshot)
        async with node_peer(hub) as sink:
            with trio.CancelScope() as relay_scope:
                async with node_peer(hub, RateLimiter(2e6)) as relay:
                    relay.keeper.update(1, HUB, sink.peer_id)
                    sink.keeper.update(1, relay.upstream, None)
                    with trio.fail_after(10):
                        while sink.keeper.transfer is None or sink.keeper.transfer.assembler.missing_count > total * 2 // 3:
                            await trio.sleep(0.01)
                    relay_scope.cancel()  # the relay's host goes away mid-transfer
            held = total - sink.keeper.transfer.assembler.missing_count
            assert 0 < held < total
            sink.keeper.update(1, HUB, None)  # the hub re-links the sink to the relay's predecessor
            await wait_installed([sink], 1, timeout_s=10)
    assert sink.installed[1] == snapshot.path.read_bytes()
    resumed = [req for peer, req in hub.requests if peer == sink.peer_id]
    assert len(resumed) == 1 and resumed[0].from_chunk == held
    assert sink.keeper.resumes == 1


@pytest.mark.trio
async def test_relink_abandons_a_stalled_upstream():
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 2, 256 * KIB, 64 * KIB)
    async with hub_peer(hub_id) as hub:
        hub.shelf.add(snapshot)
        async with node_peer(hub) as stalled, node_peer(hub) as sink:
            # `stalled` never gets v2 (nobody told it), so it holds its successor's request open.
            sink.keeper.update(2, stalled.upstream, None)
            await trio.sleep(0.5)
            assert 2 not in sink.installed
            sink.keeper.update(2, HUB, None)
            await wait_installed([sink], 2, timeout_s=5)  # well inside the relay's 20 s manifest wait
    assert sink.installed[2] == snapshot.path.read_bytes()
    assert sink.keeper.relinks == 1


@pytest.mark.trio
async def test_tampered_chunk_raises_and_nothing_unverified_is_kept():
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 4, 512 * KIB, 64 * KIB)
    async with hub_peer(hub_id) as honest:
        honest.shelf.add(snapshot)
        async with hub_peer(Identity.generate(), source=FlippingSource(honest.shelf, 3)) as liar, node_peer(honest) as node:
            assembler, error = await pull(node, liar, 4, signer=hub_id.peer_id)
    assert isinstance(error, ChunkRejected) and (error.version, error.index) == (4, 3)
    # The liar committed to the bytes it sent: proof the hub can check with the liar's key alone.
    assert error.proof is not None and error.proof.kind == "chunk" and error.proof.index == 3
    assert error.proof.digest_hex != snapshot.manifest.chunk_hashes[3]
    assert [assembler.has(i) for i in range(5)] == [True, True, True, False, False]
    assert assembler.missing_count == snapshot.manifest.chunk_count - 3


@pytest.mark.trio
async def test_a_sender_whose_file_rotted_is_dropped_without_a_proof_against_it():
    """A stored chunk is committed to by its manifest hash, unhashed: if the sender's copy rotted on disk the
    commitment is false for the bytes sent, which frames nobody (a liar's own hash of its bytes is proof)."""
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 4, 512 * KIB, 64 * KIB)
    async with hub_peer(hub_id) as hub, node_peer(hub) as node:
        hub.shelf.add(snapshot)
        with open(snapshot.path, "r+b") as f:
            f.seek(3 * 64 * KIB)
            byte = f.read(1)
            f.seek(3 * 64 * KIB)
            f.write(bytes([byte[0] ^ 0x01]))
        assembler, error = await pull(node, hub, 4)
    assert isinstance(error, ChunkRejected) and (error.version, error.index) == (4, 3)
    assert error.proof is None and "without a valid commitment" in str(error)
    assert [assembler.has(i) for i in range(4)] == [True, True, True, False]


@pytest.mark.trio
async def test_chunk_out_of_order_is_rejected():
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 4, 256 * KIB, 64 * KIB)
    manifest = snapshot.manifest

    async def skip_chunk_one(stream) -> None:
        """Sends intact, correctly labelled and committed chunks 0 and 2: only the order is wrong."""
        await read_message(stream, SnapshotRequest)
        body = snapshot.signed.to_bytes()
        await write_frame(stream, MANIFEST_FRAME, body + commit(hub_id, "manifest", 4, 0, body))
        for index in (0, 2):
            data = snapshot.path.read_bytes()[index * manifest.chunk_size : (index + 1) * manifest.chunk_size]
            await write_frame(stream, CHUNK_FRAME, encode_chunk(4, index, data) + commit(hub_id, "chunk", 4, index, data))
        await trio.sleep(5)

    async with hub_peer(hub_id) as hub, node_peer(hub) as node:
        set_handler(hub.host, SNAPSHOT_PROTOCOL, skip_chunk_one, logging.getLogger("test"))
        assembler, error = await pull(node, hub, 4)
    assert isinstance(error, ChunkRejected) and error.index == 1 and error.proof is None
    assert assembler.has(0) and not assembler.has(1) and not assembler.has(2)


@pytest.mark.trio
async def test_relay_sending_a_bad_chunk_is_reported_and_repaired_from_the_hub():
    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 7, 1 * MIB, 64 * KIB)
    async with hub_peer(hub_id) as hub:
        hub.shelf.add(snapshot)
        async with node_peer(hub, keeper_class=FlippingKeeper) as evil, node_peer(hub) as sink:
            evil.keeper.update(7, HUB, sink.peer_id)
            sink.keeper.update(7, evil.upstream, None)
            await wait_installed([evil, sink], 7, timeout_s=10)
    assert evil.installed[7] == snapshot.path.read_bytes()  # it received honestly; it only lies when serving
    assert sink.installed[7] == snapshot.path.read_bytes()
    assert [(peer, r.upstream, r.version, r.index) for peer, r in hub.reports] == [
        (sink.peer_id, evil.peer_id, 7, FlippingKeeper.BAD_INDEX)
    ]
    assert sink.keeper.distrusted == {evil.peer_id} and sink.keeper.bad_chunks_seen == 1
    # The repair pulled only what the sink lacked, from the hub.
    assert [(r.from_chunk, r.only_chunk) for peer, r in hub.requests if peer == sink.peer_id] == [
        (FlippingKeeper.BAD_INDEX, None)
    ]


@pytest.mark.trio
async def test_manifest_signed_by_another_key_is_refused():
    hub_id, impostor = Identity.generate(), Identity.generate()
    forged = random_snapshot(impostor, 9, 128 * KIB, 64 * KIB)
    async with hub_peer(hub_id) as hub, hub_peer(impostor) as fake:
        fake.shelf.add(forged)
        async with node_peer(hub) as node:
            await connect(node.host, fake.addr)
            # receive_snapshot checks against the hub id the node was given, not the sender's
            stream = await open_stream(node.host, fake.peer_id, SNAPSHOT_PROTOCOL)
            with pytest.raises(ChunkRejected, match="manifest refused") as refused:
                await receive_snapshot(
                    stream,
                    SnapshotRequest(version=9),
                    hub.peer_id,
                    fake.peer_id,
                    None,
                    lambda s, m: ChunkAssembler(m, scratch_dir() / "forged.safetensors"),
                )
            assert isinstance(refused.value.__context__, BadSignature)
            assert refused.value.proof is not None and refused.value.proof.kind == "manifest"  # provable forgery
            await stream.reset()
            # and the keeper, told to pull v9 from the impostor, never installs it
            node.keeper.update(9, Upstream(fake.peer_id, (fake.addr,)), None)
            await trio.sleep(0.5)
            assert node.installed == {} and node.keeper.transfer is None
            assert node.keeper.distrusted == {fake.peer_id}


@pytest.mark.trio
async def test_stale_version_is_refused():
    hub_id = Identity.generate()
    async with hub_peer(hub_id) as hub:
        hub.shelf.add(random_snapshot(hub_id, 5, 128 * KIB, 64 * KIB))
        async with node_peer(hub) as node:
            _, error = await pull(node, hub, None, newer_than=5)
            assert isinstance(error, ChunkRejected) and isinstance(error.__context__, StaleSnapshot), error
            _, error = await pull(node, hub, None, newer_than=4)
            assert error is None


@pytest.mark.timing
@pytest.mark.trio
async def test_served_stream_respects_the_link_limit_in_sub_chunk_slices():
    hub_id = Identity.generate()
    chunk = 1 * MIB
    snapshot = random_snapshot(hub_id, 1, 2 * MIB, chunk)
    rate = 2e6
    async with hub_peer(hub_id) as hub:
        hub.shelf.add(snapshot)
        limiter = RateLimiter(rate)
        assert limiter.slice_bytes <= chunk // 16
        async with node_peer(hub, limiter) as relay, node_peer(hub) as reader:
            relay.keeper.update(1, HUB, reader.peer_id)
            await wait_installed([relay], 1, timeout_s=5)
            await connect(reader.host, relay.addr)
            stream = await open_stream(reader.host, relay.peer_id, SNAPSHOT_PROTOCOL)
            signature = b"s" * 64  # every frame carries the sender's commitment
            expected = len(encode_frame(MANIFEST_FRAME, snapshot.signed.to_bytes() + signature)) + sum(
                len(encode_frame(CHUNK_FRAME, encode_chunk(1, i, b"x" * snapshot.manifest.chunk_length(i)) + signature))
                for i in range(snapshot.manifest.chunk_count)
            )
            await write_message(stream, SnapshotRequest(version=1))
            started = time.monotonic()
            got, samples = 0, []
            while got < expected:
                got += len(await stream.read(expected - got))
                samples.append((time.monotonic() - started, got))
            await write_message(stream, TransferAck(version=1, chunks=snapshot.manifest.chunk_count, ok=True))
            await stream.close()
    elapsed = samples[-1][0]
    assert expected / rate * 0.9 < elapsed < expected / rate * 1.5
    # Never ahead of the link by more than a few slices: a 1 MiB chunk is not sent as one burst.
    burst = max(n - rate * t for t, n in samples)
    assert burst < 8 * limiter.slice_bytes, burst


@pytest.mark.trio
async def test_a_node_serves_only_the_successor_the_hub_named():
    result = await scenario_serving_strangers()
    assert (result.detected, result.accepted, result.false_rejections) == (1, 0, 0)


@pytest.mark.trio
async def test_a_relay_that_stalls_after_its_manifest_is_left_and_reported():
    result = await scenario_stalling_relay()
    assert result.detected == result.attempts == 1


@pytest.mark.trio
async def test_a_receiver_that_never_acks_does_not_hold_the_sender():
    """A receiver takes every frame and never acks: the sender gives up after stall_s, not after an hour."""
    from shared.transfer import serve_snapshot

    hub_id = Identity.generate()
    snapshot = random_snapshot(hub_id, 2, 128 * KIB, 64 * KIB)
    shelf = SnapshotShelf(keep=1)
    shelf.add(snapshot)
    ours, theirs = trio.testing.memory_stream_pair()

    async def drain() -> None:
        while await theirs.receive_some(65536):
            pass

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        with pytest.raises(trio.TooSlowError):
            await serve_snapshot(_Adapter(ours), shelf, SnapshotRequest(version=2), None, hub_id, stall_s=0.5)
        nursery.cancel_scope.cancel()
    assert trio.current_time() - started < 5


class _Adapter:
    """A trio memory stream speaking the read/write duck type of shared/wire.py."""

    def __init__(self, stream) -> None:
        self.stream = stream

    async def read(self, n: int) -> bytes:
        return await self.stream.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)


@pytest.mark.trio
async def test_a_node_keeps_its_installed_version_and_the_one_in_flight_on_disk():
    """Files, not RAM: each pull lands in the keeper's directory; an install deletes the version before it,
    a newer version arriving mid-pull deletes the abandoned partial file."""
    hub_id = Identity.generate()
    snapshots = {v: random_snapshot(hub_id, v, 256 * KIB, 64 * KIB) for v in (1, 2, 3, 4)}
    async with hub_peer(hub_id, HubUplink(None, 0.5e6)) as hub:
        async with node_peer(hub) as node:
            directory = node.keeper.directory

            def on_disk() -> list[str]:
                return sorted(p.name for p in directory.iterdir())

            hub.shelf.add(snapshots[1])
            node.keeper.update(1, HUB, None)
            await wait_installed([node], 1, timeout_s=10)
            assert on_disk() == ["v00000001.safetensors"]
            hub.shelf.add(snapshots[2])
            node.keeper.update(2, HUB, None)
            await wait_installed([node], 2, timeout_s=10)
            assert on_disk() == ["v00000002.safetensors"]
            # v3 is abandoned half way (a slow hub uplink) when the hub re-links the node to a relay that has v4:
            # the partial v3 file goes with it.
            hub.shelf.add(snapshots[3])
            node.keeper.update(3, HUB, None)
            with trio.fail_after(10):
                while node.keeper.transfer is None or node.keeper.transfer.assembler.missing_count == 4:
                    await trio.sleep(0.01)
            assert on_disk() == ["v00000002.safetensors", "v00000003.safetensors"]
            hub.shelf.add(snapshots[4])
            async with node_peer(hub) as relay:
                relay.keeper.update(4, HUB, node.peer_id)
                node.keeper.update(4, relay.upstream, None)
                await wait_installed([node], 4, timeout_s=10)
            assert on_disk() == ["v00000004.safetensors"]
            assert node.installed[4] == snapshots[4].path.read_bytes() and 3 not in node.installed


@pytest.mark.trio
async def test_an_upstream_naming_a_version_the_hub_never_signed_does_not_freeze_the_node():
    """Issue 65: one RelayOffer(version=2**53) from a node's upstream left it asking for that version for good while
    the hub moved on. The offer is tried once, the hub's next word takes the target back to its latest, and the
    victim keeps within one version of a control node that heard no such offer."""
    hub_id = Identity.generate()
    snapshots = {v: random_snapshot(hub_id, v, 64 * KIB, 16 * KIB) for v in (1, 2, 3)}
    async with hub_peer(hub_id) as hub, node_peer(hub) as victim, node_peer(hub) as control:
        hub.shelf.add(snapshots[1])
        for node in (victim, control):
            node.keeper.update(1, HUB, None)
        await wait_installed([victim, control], 1, timeout_s=10)
        async with running_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as (attacker, addrs):
            attacker_id = attacker.get_id().to_base58()
            victim.keeper.update(1, Upstream(attacker_id, (addrs[0],)), None)  # the hub linked it below the attacker
            await connect(attacker, victim.addr)
            stream = await open_stream(attacker, victim.peer_id, RELAY_PROTOCOL)
            await write_message(stream, RelayOffer(version=2**53))
            await stream.close()
            await trio.sleep(0.2)
        for version in (2, 3):  # the attacker is gone; the hub re-links the victim and publishes on
            hub.shelf.add(snapshots[version])
            for node in (victim, control):
                node.keeper.update(version, HUB, None)
            await wait_installed([control], version, timeout_s=10)
            await wait_installed([victim], version, timeout_s=5)
            assert victim.keeper.version_held >= control.keeper.version_held - 1
            assert victim.keeper.target_version == version


class HugeManifestSource:
    """A hostile hub: serves its honest shelf, and a signed manifest of 1 TiB as version `huge`."""

    def __init__(self, shelf, hub_id: Identity, huge: int) -> None:
        self.shelf, self.huge = shelf, huge
        manifest = Manifest(
            format_version=SNAPSHOT_FORMAT_VERSION,
            version=huge,
            total_bytes=1 << 40,
            chunk_size=MAX_CHUNK_BYTES,
            chunk_hashes=("0" * 64,) * ((1 << 40) // MAX_CHUNK_BYTES),
            whole_hash="0" * 64,
            config_hash="0" * 64,
            created_at=0.0,
            signer=hub_id.peer_id,
        )
        self.signed = (sign_manifest(manifest, hub_id), manifest)

    def held_manifest(self, version, base_version=None):
        return self.signed if version == self.huge else self.shelf.held_manifest(version, base_version)

    async def chunk(self, version: int, index: int, delta: bool = False) -> bytes:
        if version == self.huge:
            return b"\0" * MAX_CHUNK_BYTES
        return await self.shelf.chunk(version, index, delta)


@pytest.mark.trio
async def test_a_signed_manifest_past_the_models_size_is_refused_before_a_byte_is_written(caplog):
    """Issue 65: a hub's signed manifest of 1 TiB for a small model made the node create the file and write 2 GiB."""
    caplog.set_level(logging.WARNING, "echo2.node.keeper")
    hub_id = Identity.generate()
    shelf = SnapshotShelf(keep=4)
    async with hub_peer(hub_id, source=HugeManifestSource(shelf, hub_id, huge=1)) as hub, node_peer(hub) as node:
        node.keeper.update(1, HUB, None)
        with trio.fail_after(5):
            while not any("refused before a byte" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.02)
        assert list(node.keeper.directory.iterdir()) == [] and node.keeper.transfer is None
        shelf.add(random_snapshot(hub_id, 2, 64 * KIB, 16 * KIB))  # an honest next version passes
        node.keeper.update(2, HUB, None)
        await wait_installed([node], 2, timeout_s=10)
    assert 1 not in node.installed
