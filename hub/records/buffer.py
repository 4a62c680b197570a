"""Replay buffer of versioned groups with the staleness rule t - version <= S (docs/DESIGN.md §3).

Pure Python and not thread-safe: the hub touches it only from its trio thread. Trio
users wait for data with `BufferSignal` (a trio.Condition notified on every add), so
the learner sleeps instead of polling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import trio

from shared.rollout import Group

REASON_ZERO_VARIANCE = "zero reward variance"
REASON_STALE = "stale"


@dataclass(frozen=True)
class AddResult:
    accepted: bool
    reason: str | None = None


@dataclass(frozen=True)
class TakeResult:
    groups: tuple[Group, ...]
    row_ids: tuple[int, ...]
    dropped_stale: int
    dropped_row_ids: tuple[int, ...]
    staleness: tuple[int, ...]


def has_reward_variance(group: Group) -> bool:
    return len(set(group.rewards)) > 1


def usable_from(step: int, staleness: int) -> int:
    """The oldest version a take at `step` (the version the learner's next update starts from) trains on: a group
    made with version x is used only if step - x <= S."""
    return step - staleness


def leasable(room: float, coming: int, usable: float) -> float:
    """Prompts that may still be leased when the takes can train on `room` more queued prompts than the buffer holds
    (the buffer takes no zero-variance group, so its groups count whole): of the prompts still coming (leased, or
    accepted and being committed) and of a new lease, only the share `usable` that the hub measured ends up trained
    on (hub.method.capacity.fresh_usable_fraction). The in-flight cap and `fresh_room` count in trained prompts, as
    the scheduler sizes the fleet by R / usable: counted raw, a reward that scores half of its groups alike would
    cap the work in flight at half of what the learner trains on."""
    return room / usable - coming


def fresh_room(takes: int, prompts_per_step: float, queued: float) -> float:
    """Prompts a node may be leased and still see trained, its version used by the next `takes` takes
    (hub.records.measurements.takes_served): takes go oldest version first, so the `queued` prompts (buffered, on
    their way in, leased) fill those takes first. Every queued prompt counts as ahead, a newer version's too (it
    goes after): this errs toward leasing less."""
    return takes * prompts_per_step - queued


class ReplayBuffer:
    """Complete groups, each tagged with its policy version and store row id, oldest first."""

    def __init__(self, capacity_groups: int, staleness: int, skip_zero_variance: bool) -> None:
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.capacity_groups = capacity_groups
        self.staleness = staleness
        self.skip_zero_variance = skip_zero_variance
        self._items: deque[tuple[Group, int]] = deque()
        # Every group offered, useful for training or not: what the policy's rollouts score.
        self.offered = 0
        self.offered_reward_sum = 0.0
        self.offered_zero_std = 0  # of them, the groups whose completions all scored the same (TRL's zero std)
        self.offered_tool_rounds = 0.0  # their rollouts' mean rounds of tool calls answered, summed over groups

    def __len__(self) -> int:
        return len(self._items)

    def row_ids(self) -> list[int]:
        return [row_id for _, row_id in self._items]

    def add(self, group: Group, row_id: int) -> AddResult:
        self.offered += 1
        self.offered_reward_sum += sum(group.rewards) / len(group.rewards)
        self.offered_zero_std += not has_reward_variance(group)
        self.offered_tool_rounds += sum(len(c.env_spans) for c in group.completions) / len(group.completions)
        if self.skip_zero_variance and not has_reward_variance(group):
            return AddResult(False, REASON_ZERO_VARIANCE)
        if len(self._items) >= self.capacity_groups:
            return AddResult(False, f"buffer full: {self.capacity_groups} groups")
        # Keep version order so "oldest usable first" is a scan from the left; groups
        # mostly arrive in version order, so the insertion point is almost always the end.
        index = len(self._items)
        while index > 0 and self._items[index - 1][0].version > group.version:
            index -= 1
        self._items.insert(index, (group, row_id))
        return AddResult(True)

    def _usable(self, version: int, group: Group) -> bool:
        return group.version >= usable_from(version, self.staleness)

    def ready(self, step: int, k: int) -> bool:
        """True when `take(step, k)` would return k groups."""
        return sum(1 for g, _ in self._items if self._usable(step, g)) >= k

    def prune(self, step: int) -> tuple[int, ...]:
        """Drop groups too stale for `step`; their row ids (the store records them as dropped).

        Stale groups only get staler, so dropping them loses nothing a later step could use.
        """
        dropped = tuple(row_id for g, row_id in self._items if not self._usable(step, g))
        if dropped:
            self._items = deque((g, r) for g, r in self._items if self._usable(step, g))
        return dropped

    def take(self, step: int, k: int) -> TakeResult:
        """Up to k usable groups, oldest first, after dropping the ones too stale for `step`.

        `step` is the version the learner's next update starts from (see hub/training/loop.py).
        """
        dropped = self.prune(step)
        groups: list[Group] = []
        ids: list[int] = []
        while self._items and len(groups) < k:
            group, row_id = self._items.popleft()
            groups.append(group)
            ids.append(row_id)
        return TakeResult(
            groups=tuple(groups),
            row_ids=tuple(ids),
            dropped_stale=len(dropped),
            dropped_row_ids=dropped,
            staleness=tuple(step - g.version for g in groups),
        )

    def drop_node(self, node_id: str) -> list[int]:
        """Remove every group made by `node_id` (a banned node); their row ids, for the store to discard."""
        if not node_id:
            raise ValueError("node_id must name a node ('' marks the hub's own rollouts)")
        dropped = [row_id for g, row_id in self._items if g.node_id == node_id]
        if dropped:
            self._items = deque((g, r) for g, r in self._items if g.node_id != node_id)
        return dropped


class BufferSignal:
    """Wakes trio tasks waiting for a change of the buffer or of the policy version.

    Producers call `notify()` after adding, the learner after taking and publishing. A fresh
    trio.Event per generation, so notify() is synchronous and never blocks a producer.
    Usage: `while not condition(): await signal.wait()` (no change can slip between the
    check and the wait, since both run in the trio thread without a checkpoint between).
    """

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        """Return after the next notify()."""
        await self._event.wait()
