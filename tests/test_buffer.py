"""Replay buffer: staleness rule, oldest-first order, counted refusals."""

from __future__ import annotations

import pytest
import trio

from hub.records.buffer import BufferSignal, ReplayBuffer
from shared.rollout import Completion, Group


def group(version: int, rewards: tuple[float, ...] = (0.0, 1.0), pid: str = "p") -> Group:
    completions = tuple(
        Completion(token_ids=(1,), logprobs=(-0.5,), finish_reason="stop", version=version, text="x") for _ in rewards
    )
    return Group(prompt_id=pid, prompt_text="x>", version=version, completions=completions, rewards=rewards)


def test_oldest_usable_first_and_stale_dropped():
    buf = ReplayBuffer(capacity_groups=10, staleness=2, skip_zero_variance=True)
    for row_id, version in [(1, 3), (2, 1), (3, 4), (4, 2), (5, 0)]:
        assert buf.add(group(version), row_id).accepted
    # Step 4, S=2: versions 0 and 1 are stale (4-1=3>2); usable 2,3,4 oldest first.
    assert buf.ready(4, 3) and not buf.ready(4, 4)
    out = buf.take(4, 2)
    assert out.row_ids == (4, 1)
    assert out.staleness == (2, 1)
    assert out.dropped_stale == 2 and set(out.dropped_row_ids) == {2, 5}
    assert buf.row_ids() == [3] and len(buf) == 1


def test_prune_keeps_order():
    buf = ReplayBuffer(capacity_groups=10, staleness=1, skip_zero_variance=False)
    for row_id, version in [(1, 0), (2, 2), (3, 1)]:
        buf.add(group(version), row_id)
    assert buf.prune(2) == (1,)
    assert buf.row_ids() == [3, 2]
    assert buf.prune(2) == ()


def test_staleness_zero_is_on_policy_only():
    buf = ReplayBuffer(capacity_groups=10, staleness=0, skip_zero_variance=False)
    buf.add(group(4), 1)
    buf.add(group(5), 2)
    out = buf.take(5, 5)
    assert out.row_ids == (2,) and out.dropped_row_ids == (1,)


def test_zero_variance_refused():
    buf = ReplayBuffer(capacity_groups=10, staleness=4, skip_zero_variance=True)
    res = buf.add(group(0, (1.0, 1.0)), 1)
    assert not res.accepted and res.reason == "zero reward variance"
    assert len(buf) == 0
    keep = ReplayBuffer(capacity_groups=10, staleness=4, skip_zero_variance=False)
    assert keep.add(group(0, (1.0, 1.0)), 1).accepted


def test_capacity_refusal_with_reason():
    buf = ReplayBuffer(capacity_groups=2, staleness=4, skip_zero_variance=True)
    assert buf.add(group(0), 1).accepted and buf.add(group(0), 2).accepted
    res = buf.add(group(0), 3)
    assert res == type(res)(False, "buffer full: 2 groups") and buf.row_ids() == [1, 2]


@pytest.mark.trio
async def test_signal_wakes_waiter():
    buf = ReplayBuffer(capacity_groups=10, staleness=1, skip_zero_variance=True)
    signal = BufferSignal()
    woke = []

    async def waiter():
        while not buf.ready(0, 2):
            await signal.wait()
        woke.append(len(buf))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(0.01)
        buf.add(group(0), 1)
        signal.notify()
        await trio.sleep(0.01)
        assert woke == []
        buf.add(group(0), 2)
        signal.notify()
    assert woke == [2]


def test_the_cutoff_the_buffer_and_the_simulator_share():
    from hub.records.buffer import usable_from

    # A take at step 10 under S = 3 trains on versions 7..10; at S = 0 on version 10 only.
    assert usable_from(10, 3) == 7
    assert usable_from(10, 0) == 10
    assert usable_from(2, 4) == -2  # early on, every version made so far


def test_fresh_room_counts_the_takes_a_version_still_serves_by_hand():
    from hub.records.buffer import fresh_room

    # 4 prompts a step, 6 queued: a version that serves one more take has no room left (4 - 6 = -2), one that serves
    # three has 12 - 6 = 6 (how many a version serves: hub.records.measurements.takes_served).
    assert fresh_room(1, 4, 6) == -2
    assert fresh_room(3, 4, 6) == 6
    assert fresh_room(0, 4, 0) == 0


def test_leasable_counts_the_coming_prompts_and_a_new_lease_at_the_usable_share_by_hand():
    from hub.records.buffer import leasable

    # Room for 6 more trained prompts than the buffer holds, 8 prompts leased or being committed, half of what is
    # leased measured to end up trained on: 6 / 0.5 - 8 = 4 more prompts. Counted raw (usable 1.0): 6 - 8 = -2.
    assert leasable(6, 8, 0.5) == 4
    assert leasable(6, 8, 1.0) == -2
    assert leasable(4, 18, 0.2) == 2  # not (4 - 0.2 * 18) / 0.2, which rounds to 1.999...
