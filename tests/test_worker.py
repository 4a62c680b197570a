"""The node's worker against hub replies it must act on (the protocol itself is tested against a real hub in
test_p2p_negative.py and end to end in test_p2p.py)."""

from __future__ import annotations

import pytest
import trio

from node.worker import Worker
from shared.messages import Reject, RejectCode


class ForgottenBy:
    """A hub client whose hub no longer knows this node (it restarted, or dropped the node as silent)."""

    peer_id = "node"

    def __init__(self) -> None:
        self.asked = 0

    async def lease(self, version_held: int) -> Reject:
        self.asked += 1
        return Reject(code=RejectCode.UNKNOWN_NODE, reason="unknown node: join first")


@pytest.mark.trio
async def test_a_hub_that_forgot_the_node_makes_the_link_beat_at_once():
    nudged = trio.Event()
    client = ForgottenBy()
    worker = Worker(client, engine=None, engine_lock=trio.Lock(), can_work=lambda: True, version_held=lambda: 0,
                    max_rollouts_per_s=None, on_unknown=nudged.set)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            await nudged.wait()
            nursery.cancel_scope.cancel()
    assert client.asked == 1
