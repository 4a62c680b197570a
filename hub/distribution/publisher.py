"""The snapshot's last hop inside the hub: each snapshot the learner publishes goes onto the shelf (which lets the
oldest go), then out to the fleet through the broadcaster. One component of the hub's nursery; the learner's channel
to it is unbuffered, so the learner writes its next snapshot only once the shelf took (and pruned for) the last."""

from __future__ import annotations

from typing import Protocol

import trio

from hub.distribution.broadcast import Broadcaster
from hub.records.snapshots import SnapshotShelf
from shared.snapshot import Snapshot


class Published(Protocol):
    """A snapshot the learner wrote (hub/training/loop.py SnapshotPublished), with its delta when there is one."""

    @property
    def version(self) -> int: ...

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def delta(self) -> Snapshot | None: ...


class SnapshotPublisher:
    """Shelves every published snapshot, then starts its broadcast."""

    def __init__(self, published: trio.MemoryReceiveChannel[Published], shelf: SnapshotShelf, broadcaster: Broadcaster) -> None:
        self.published = published
        self.shelf = shelf
        self.broadcaster = broadcaster

    async def run(self) -> None:
        async for published in self.published:
            self.shelf.add(published.snapshot, published.delta)
            await self.broadcaster.publish(published.version)
