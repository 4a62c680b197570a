"""Test-only corrupt relay: the real node runtime, whose keeper flips one byte of chunk CORRUPT_INDEX
of every snapshot it serves to a peer. It receives, verifies and installs honestly; it only lies
when relaying. No switch for this exists in the production code.

Usage: python -m testbed.evil_node join --hub ... (the `echo-node join` flags), or `main(argv)`
"""

from __future__ import annotations

import sys

from node.keeper import SnapshotKeeper
from testbed.recording_node import record_installs

CORRUPT_INDEX = 1


def corrupt_relaying() -> None:
    chunk = SnapshotKeeper.chunk

    async def corrupt_chunk(self: SnapshotKeeper, version: int, index: int, delta: bool = False) -> bytes:
        data = await chunk(self, version, index, delta)
        return bytes([data[0] ^ 0xFF]) + data[1:] if index == CORRUPT_INDEX else data

    SnapshotKeeper.chunk = corrupt_chunk


def main(argv: list[str] | None = None) -> int:
    """`echo-node` with its installs recorded, relaying corrupt chunks."""
    record_installs()
    corrupt_relaying()
    from node.cli import main as node_main

    return node_main(argv)


if __name__ == "__main__":
    sys.exit(main())
