"""Room in the replay buffer promised to accepted groups on their way in.

A submission's accepted groups are counted against the buffer's capacity before their commit, so
concurrent submissions cannot overfill it with groups their nodes were told were accepted, and new
leases count them against the work in flight. The room is given back when the groups enter the buffer
or are discarded (after their audit, for a node on probation), or at once if their commit fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hub.records.buffer import ReplayBuffer


class BufferRoom:
    """The buffer's groups plus those reserved for it: accepted, committed or being committed."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer
        self.reserved = 0

    def in_use(self) -> int:
        """Groups in the buffer or on their way in."""
        return len(self.buffer) + self.reserved

    def fits(self, groups: int) -> bool:
        """Whether `groups` more accepted groups fit (none always do)."""
        return groups == 0 or self.in_use() + groups <= self.buffer.capacity_groups

    @contextmanager
    def reserving(self, groups: int) -> Iterator[None]:
        """Reserve room for `groups` while the block commits them; given back at once if the commit fails,
        else by `release` once they are in the buffer or discarded."""
        self.reserved += groups
        try:
            yield
        except BaseException:
            self.reserved -= groups
            raise

    def release(self, groups: int) -> None:
        """Reserved groups now in the buffer or discarded."""
        self.reserved -= groups
