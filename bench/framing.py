"""Throughput of framed binary chunks over one loopback libp2p stream (Noise + Yamux), and connect time.

Two hosts in one process: the sender writes `--mb` MiB as frames of `--chunk-kib` KiB on a
single stream, the receiver reads them with shared.wire.read_frame and answers with an ack
once all bytes are in; throughput is measured from the first write to the ack. Connect
time is the median of fresh dials, for our host config (one connection per peer) and for
py-libp2p's default ConnectionConfig (three per peer) for comparison.

    python bench/framing.py [--json] [--mb 64] [--chunk-kib 1024] [--dials 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p import new_host
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP
from multiaddr import Multiaddr
from rich.progress import BarColumn, Progress, TextColumn, TransferSpeedColumn

from shared.crypto import Identity
from shared.net import connect, open_stream, running_host, set_handler
from shared.wire import Message, protocol_id, read_frame, read_message, write_frame, write_message

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
BENCH_PROTOCOL = protocol_id("bench-framing")
CHUNK_TAG = 254
ACK_TIMEOUT_S = 600.0
log = logging.getLogger("bench.framing")


class Received(Message):
    TYPE = 199
    MAX_BYTES = 128
    total_bytes: int
    chunks: int


def make_receiver(expected_bytes: int, chunk_bytes: int):
    async def receive(stream) -> None:
        total = chunks = 0
        while total < expected_bytes:
            _, body = await read_frame(stream, {CHUNK_TAG: chunk_bytes})
            total += len(body)
            chunks += 1
        await write_message(stream, Received(total_bytes=total, chunks=chunks))
        await stream.close()

    return receive


@asynccontextmanager
async def default_config_host(identity: Identity, listen: list[str]) -> AsyncIterator[tuple]:
    """A host like shared.net.build_host's but with py-libp2p's default ConnectionConfig."""
    key_pair = identity.libp2p_keypair()
    host = new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        transports=[TCP()],
    )
    async with host.run(listen_addrs=[Multiaddr(a) for a in listen]):
        yield host, [str(a) for a in host.get_addrs()]


async def median_connect_ms(server_addr: str, dials: int, default_config: bool) -> float:
    times_ms = []
    for _ in range(dials):
        identity = Identity.generate()
        make_host = default_config_host if default_config else running_host
        async with make_host(identity, [LOOPBACK]) as (host, _):
            start = time.perf_counter()
            await connect(host, server_addr)
            times_ms.append((time.perf_counter() - start) * 1000)
    return statistics.median(times_ms)


async def run(total_mb: int, chunk_kib: int, dials: int, show_progress: bool) -> dict:
    chunk_bytes = chunk_kib * 1024
    n_chunks = max(1, total_mb * 1024 * 1024 // chunk_bytes)
    total_bytes = n_chunks * chunk_bytes
    chunk = bytes(range(256)) * (chunk_bytes // 256) + bytes(chunk_bytes % 256)

    server_id, client_id = Identity.generate(), Identity.generate()
    async with running_host(server_id, [LOOPBACK]) as (server, (server_addr, *_)):
        set_handler(server, BENCH_PROTOCOL, make_receiver(total_bytes, chunk_bytes), log)
        connect_ms = await median_connect_ms(server_addr, dials, default_config=False)
        connect_ms_default = await median_connect_ms(server_addr, dials, default_config=True)

        async with running_host(client_id, [LOOPBACK]) as (client, _):
            await connect(client, server_addr)
            stream = await open_stream(client, server_id.peer_id, BENCH_PROTOCOL)
            progress = Progress(TextColumn("framed chunks"), BarColumn(), TransferSpeedColumn(), disable=not show_progress)
            with progress:
                task = progress.add_task("send", total=total_bytes)
                start = time.perf_counter()
                with trio.fail_after(ACK_TIMEOUT_S):
                    for _ in range(n_chunks):
                        await write_frame(stream, CHUNK_TAG, chunk)
                        progress.advance(task, chunk_bytes)
                    ack = await read_message(stream, Received)
                elapsed_s = time.perf_counter() - start
            await stream.close()

    if ack.total_bytes != total_bytes or ack.chunks != n_chunks:
        raise RuntimeError(f"receiver got {ack.total_bytes} bytes in {ack.chunks} chunks, sent {total_bytes} in {n_chunks}")
    return {
        "mb_per_s": round(total_bytes / 1e6 / elapsed_s, 2),
        "mib_per_s": round(total_bytes / 2**20 / elapsed_s, 2),
        "connect_ms": round(connect_ms, 2),
        "connect_ms_default_conn_config": round(connect_ms_default, 2),
        "total_bytes": total_bytes,
        "chunk_bytes": chunk_bytes,
        "chunks": n_chunks,
        "elapsed_s": round(elapsed_s, 3),
        "dials": dials,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--mb", type=int, default=64, help="MiB to send")
    parser.add_argument("--chunk-kib", type=int, default=1024, help="frame body size in KiB")
    parser.add_argument("--dials", type=int, default=5, help="fresh dials per connect-time figure")
    args = parser.parse_args()
    result = trio.run(run, args.mb, args.chunk_kib, args.dials, not args.json)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
