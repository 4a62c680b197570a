"""Test-only `echo-node`: the real node runtime, whose work the hub must refuse twice, once for each kind of reason.
Its first lease (the hub's probe) is answered honestly; its second with one group's log-probs made positive: rejected
as bad work. Its third is generated at once but submitted only once the node holds a version LAG past the one it was
made with, while the worker answers further leases honestly and so moves the learner on: late. No switch for either exists in
the production code.

Usage: python -m testbed.laggard_node join --hub ... (the `echo-node join` flags), or `main(argv)`
"""

from __future__ import annotations

import sys

import trio

from node.worker import Worker
from shared.messages import Lease, SubmitReply, SubmittedGroup

# Versions past the one its held-back lease was made with before the node submits it: past any S a test hub runs.
LAG = 3
# How often the held-back lease looks at the version the node holds.
POLL_S = 0.1


def misbehave() -> None:
    run, work = Worker.run, Worker.work
    leases = [0]

    async def broken(lease: Lease, groups: tuple[SubmittedGroup, ...]) -> tuple[SubmittedGroup, ...]:
        first = groups[0]
        bad = tuple(c.model_copy(update={"logprobs": (0.5,) * len(c.logprobs)}) for c in first.completions)
        return (first.model_copy(update={"completions": bad}), *groups[1:])

    async def run_with_room(self: Worker) -> None:
        async with trio.open_nursery() as nursery:
            self.laggard_nursery = nursery  # type: ignore[attr-defined]
            await run(self)

    async def answer(self: Worker, lease: Lease, rewrite=None) -> SubmitReply | None:
        leases[0] += 1
        if leases[0] == 2:
            return await work(self, lease, broken)
        if leases[0] == 3:

            async def behind(lease: Lease, groups: tuple[SubmittedGroup, ...]) -> tuple[SubmittedGroup, ...]:
                made = groups[0].completions[0].version
                while self.version_held() < made + LAG:
                    await trio.sleep(POLL_S)
                return groups

            self.laggard_nursery.start_soon(work, self, lease, behind)  # type: ignore[attr-defined]
            return None  # the worker takes its next lease meanwhile
        return await work(self, lease, rewrite)

    Worker.run = run_with_room  # type: ignore[method-assign]
    Worker.work = answer  # type: ignore[method-assign,assignment]


def main(argv: list[str] | None = None) -> int:
    """`echo-node` whose first lease is rejected and whose second is late."""
    misbehave()
    from node.cli import main as node_main

    return node_main(argv)


if __name__ == "__main__":
    sys.exit(main())
