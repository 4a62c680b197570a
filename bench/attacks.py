"""Attacks on the reward's budget against the real hub on loopback (measured and printed as JSON).

A few identities flood the hub with groups its reward spends SPIN_S of CPU on, as sympy spent minutes on a
boxed \\exp tower (untrusted peers, round four, item 1), while an honest node keeps working and heartbeating.
The hub is the real service, state, store and checks in process (testbed/inproc.py), its task
testbed.poisoned_tasks:SpinningRewardTask; each node is a real libp2p host. Printed per check mode
(check process, hub thread): the honest node's submissions answered within HANDLER_TIMEOUT_S and accepted,
its submission and heartbeat round trips (p50, max) before and under the flood, the poisoned groups rejected
past their budget and counted against their senders, and whether the run stopped.

Usage: python bench/attacks.py [--attackers 3] [--seconds 20] [--modes process,thread]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import trio
from transformers import AutoTokenizer

from hub.config import HubConfig, LearnerConfig, LeaseConfig
from hub.service.leasing import HANDLER_TIMEOUT_S
from hub.trust.submissions import REASON_OVER_BUDGET
from node.client import HubClient
from shared.crypto import Identity
from shared.default_model import ensure_default_model
from shared.messages import Heartbeat, JoinReply, JoinRequest, LeaseReply, Submission, SubmitReply, SubmittedGroup
from shared.net import running_host
from shared.rollout import Completion, SamplingParams
from testbed.inproc import LOOPBACK, PERMISSIVE_TRUST, InprocHub, inproc_hub
from testbed.poisoned_tasks import POISON

MODES = {"process": 1, "thread": 0}  # --check-procs of each mode
REWARD_BUDGET_S = 0.05  # CPU per completion: a poisoned group (SPIN_S of CPU) is far past it


class Node:
    """One node of the bench: a HubClient that makes completions with the hub's tokenizer."""

    def __init__(self, client: HubClient, hub: InprocHub, tokenizer) -> None:
        self.client, self.hub, self.tokenizer = client, hub, tokenizer

    def completion(self, text: str) -> Completion:
        ids = (*self.tokenizer.encode(text), self.tokenizer.eos_token_id)
        return Completion(token_ids=ids, logprobs=(-0.5,) * len(ids), finish_reason="stop", version=self.hub.version, text=text)

    async def join(self) -> None:
        reply = await self.client.join(
            JoinRequest(
                price_per_hour=0.5,
                hardware="bench",
                link_bps=1e8,
                backend="hf",
                dtype="float32",
                model_config_hash=self.hub.config_hash,
                version_held=0,
            )
        )
        assert isinstance(reply, JoinReply), reply

    async def lease(self):
        with trio.fail_after(HANDLER_TIMEOUT_S):
            while True:
                reply = await self.client.lease(self.hub.version)
                if isinstance(reply, LeaseReply) and reply.lease is not None:
                    return reply.lease
                await trio.sleep(0.05)

    async def work(self, poisoned: bool) -> tuple[float, SubmitReply | None]:
        """Lease, answer (rightly, or with POISON in every group) and submit: (seconds to the reply, the reply)."""
        lease = await self.lease()
        groups = tuple(
            SubmittedGroup(
                prompt_id=p.prompt_id,
                completions=tuple(self.completion(t) for t in ((POISON, "x") if poisoned else (p.text[:-1][::-1], p.text[:-1]))),
            )
            for p in lease.prompts
        )
        start = time.monotonic()
        with trio.move_on_after(HANDLER_TIMEOUT_S + 5):
            reply = await self.client.submit(Submission(lease_id=lease.lease_id, node_id=self.client.peer_id, groups=groups))
            return time.monotonic() - start, reply if isinstance(reply, SubmitReply) else None
        return time.monotonic() - start, None

    async def beat(self) -> float:
        start = time.monotonic()
        await self.client.heartbeat(Heartbeat(version_held=self.hub.version))
        return time.monotonic() - start


def summary(seconds: list[float]) -> dict:
    return {
        "n": len(seconds),
        "p50_ms": round(1000 * statistics.median(seconds), 1) if seconds else None,
        "max_ms": round(1000 * max(seconds), 1) if seconds else None,
    }


async def honest_round(node: Node, until: float, out: dict) -> None:
    """Submissions and heartbeats of the honest node until `until` (time.monotonic)."""
    async with trio.open_nursery() as nursery:

        async def beats() -> None:
            while time.monotonic() < until:
                out["beats"].append(await node.beat())
                await trio.sleep(0.2)

        nursery.start_soon(beats)
        while time.monotonic() < until:
            took, reply = await node.work(poisoned=False)
            out["submits"].append(took)
            out["answered_in_time"] += reply is not None and took <= HANDLER_TIMEOUT_S
            out["accepted_all"] += reply is not None and reply.accepted > 0 and not reply.rejected


async def run_mode(procs: int, attackers: int, seconds: float, work: Path, model_dir: Path) -> dict:
    trust = PERMISSIVE_TRUST.model_copy(update={"check_procs": procs, "reward_budget_s": REWARD_BUDGET_S})
    # Room for every lease of the bench: no learner takes groups out of the buffer (as bench/p2p.py).
    config = HubConfig(
        learner=LearnerConfig(staleness=2, prompts_per_step=4096, group_size=2, buffer_max_groups=1_000_000),
        sampling=SamplingParams(max_new_tokens=32),
        lease=LeaseConfig(prompts_per_lease=2, max_inflight_steps=100.0),
        trust=trust,
        task="testbed.poisoned_tasks:SpinningRewardTask",
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    async with inproc_hub(work, model_dir, config) as hub, AsyncExitStack() as stack:
        nodes = []
        for _ in range(attackers + 1):
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
            client = HubClient(host, identity, hub.addr, timeout_s=HANDLER_TIMEOUT_S + 5)
            await client.connect()
            nodes.append(Node(client, hub, tokenizer))
        honest, *flooders = nodes
        for node in nodes:
            await node.join()
        await honest.work(poisoned=False)  # the first check waits for the check process to start
        quiet = {"beats": [], "submits": [], "answered_in_time": 0, "accepted_all": 0}
        await honest_round(honest, time.monotonic() + seconds / 2, quiet)
        flood = {"beats": [], "submits": [], "answered_in_time": 0, "accepted_all": 0}
        charged = {"submissions": 0, "groups_rejected_over_budget": 0, "unanswered": 0}
        until = time.monotonic() + seconds

        async def attack(node: Node) -> None:
            while time.monotonic() < until:
                _, reply = await node.work(poisoned=True)
                if reply is None:
                    charged["unanswered"] += 1
                    continue
                charged["submissions"] += 1
                charged["groups_rejected_over_budget"] += sum(r == REASON_OVER_BUDGET for _, r in reply.rejected)

        async with trio.open_nursery() as nursery:
            for node in flooders:
                nursery.start_soon(attack, node)
            nursery.start_soon(honest_round, honest, until, flood)
        tallies = [hub.state.fleet.get(n.client.peer_id).tallies for n in flooders]
        return {
            "check_procs": procs,
            "attackers": attackers,
            "honest_quiet": {"submit": summary(quiet["submits"]), "heartbeat": summary(quiet["beats"])},
            "honest_under_flood": {
                "submit": summary(flood["submits"]),
                "heartbeat": summary(flood["beats"]),
                "answered_within_deadline": f"{flood['answered_in_time']}/{len(flood['submits'])}",
                "accepted": f"{flood['accepted_all']}/{len(flood['submits'])}",
            },
            "poisoned": charged,
            "attackers_rejected_in_tallies": sum(t.rejected for t in tallies),
            "attackers_accepted_in_tallies": sum(t.accepted for t in tallies),
            "run_stopped": hub.state.intake.reward_failure is not None,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attackers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the flood (the quiet spell: half)")
    parser.add_argument("--modes", default="process,thread", help=f"comma-separated: {', '.join(MODES)}")
    args = parser.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    model_dir = ensure_default_model(progress=False)
    results = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as work:
            result = trio.run(run_mode, MODES[mode], args.attackers, args.seconds, Path(work), model_dir)
            results.append({"mode": mode, **result})
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
