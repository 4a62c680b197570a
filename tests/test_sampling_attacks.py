"""Chosen, not sampled: on a real hub (loopback, the embedded default model, audits on), nodes that submit completions
they chose, each with its tokens' true log-probs (so every audit of the log-probs passes), are condemned by the
sampling test (hub/trust/sampling.py) within a few groups, banned with the evidence in words and unpaid, and an
honest node serving the same hub is never touched."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from hub.config import HubConfig, LearnerConfig, LeaseConfig
from shared.rollout import Completion, SamplingParams
from tests.test_copies import Volunteer

# The groups a cheat may send before its ban: bench/sampling.py catches these at temperature 1 within 1 (random
# strings), ~4 (edits) and ~7 (greedy) re-scored groups.
CAUGHT_WITHIN_GROUPS = 24


def with_true_logprobs(engine, prompt: str, rows: list[list[int]], version: int) -> list[Completion]:
    """Completions of these token ids, each token's log-prob what the policy gives it (temperature 1, no top-p: the
    run's sampling), so an audit of the log-probs finds nothing."""
    ids = engine.tokenizer(prompt)["input_ids"]
    scored = engine.score([ids] * len(rows), rows)
    return [
        Completion(
            token_ids=tuple(r),
            logprobs=tuple(lp),
            finish_reason="stop" if r[-1] in engine.stop_ids else "length",
            version=version,
            text="chosen",
        )
        for r, lp in zip(rows, scored)
    ]


def body(row: list[int], stop_ids: frozenset[int]) -> int:
    """How many of a row's tokens precede its stop token (all of them when it ran to max_new_tokens)."""
    return len(row) - 1 if row[-1] in stop_ids else len(row)


class Cheat(Volunteer):
    """A node whose groups are `choose(prompt, honest completions)`: token ids it picked, at their true log-probs."""

    def __init__(self, hub, host, identity, engine, choose) -> None:
        super().__init__(hub, host, identity, engine)
        self.choose = choose
        self.sent = 0

    def banned(self) -> bool:
        return self.hub.state.fleet.get(self.peer_id).state == "banned"

    async def answer_chosen(self) -> None:
        """One lease answered with chosen completions; nothing when the hub banned it meanwhile (its audits run
        while it works: a ban may land between any two of its requests)."""
        from shared.messages import LeaseReply, Submission, SubmitReply, SubmittedGroup

        with trio.fail_after(30):
            while isinstance(reply := await self.client.lease(0), LeaseReply) and reply.lease is None:
                await trio.sleep(0.05)  # standby until the scheduler activates it
        if not isinstance(reply, LeaseReply):
            assert self.banned(), reply
            return
        lease = reply.lease
        prompt = lease.prompts[0]
        honest = await trio.to_thread.run_sync(self.engine.generate, [prompt.text], lease.group_size, lease.sampling)
        rows = self.choose(prompt.text, [list(c.token_ids) for c in honest[0]])
        completions = await trio.to_thread.run_sync(with_true_logprobs, self.engine, prompt.text, rows, self.hub.version)
        group = SubmittedGroup(prompt_id=prompt.prompt_id, completions=tuple(completions))
        answer = await self.client.submit(Submission(lease_id=lease.lease_id, node_id=self.peer_id, groups=(group,)))
        assert isinstance(answer, SubmitReply) or self.banned(), answer
        self.sent += 1


@pytest.mark.trio
async def test_chosen_completions_are_condemned_by_the_sampling_test_and_an_honest_node_is_not(tmp_path, default_model_dir):
    from node.hf_engine import HFEngine
    from shared.crypto import Identity
    from shared.net import running_host
    from testbed.inproc import LOOPBACK, PERMISSIVE_TRUST, inproc_hub

    torch.manual_seed(0)
    rng = random.Random(0)
    config = HubConfig(
        learner=LearnerConfig(staleness=2, prompts_per_step=8, group_size=8),
        lease=LeaseConfig(prompts_per_lease=1),
        # Every group audited (a new node's are, until audit_first_n): the sampling test sees each.
        trust=PERMISSIVE_TRUST.model_copy(update={"audit_first_n": 10_000, "audit_rate": 1.0}),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10),
    )
    engine = HFEngine(default_model_dir)
    vocab = engine.vocab_size

    def random_strings(prompt: str, honest: list[list[int]]) -> list[list[int]]:
        """The issue's attack: one honest answer (the one that may be right) and seven strings of random tokens."""
        stop = engine.stop_ids
        return [honest[0]] + [
            [rng.randrange(vocab) for _ in range(body(row, stop))] + row[body(row, stop) :] for row in honest[1:]
        ]

    def greedy(prompt: str, honest: list[list[int]]) -> list[list[int]]:
        with torch.inference_mode():
            picks = engine.sampler.generate([prompt], len(honest), config.sampling, 0, greedy=True)[0]
        return [list(c.token_ids) for c in picks]

    def edited(prompt: str, honest: list[list[int]]) -> list[list[int]]:
        """A copy of honest work with one token of every completion changed: no digest matches it."""
        out = [list(row) for row in honest]
        for row in out:
            if body(row, engine.stop_ids):
                row[rng.randrange(body(row, engine.stop_ids))] = rng.randrange(vocab)
        return out

    async with inproc_hub(tmp_path, default_model_dir, config, real_weights=True) as hub, AsyncExitStack() as stack:

        async def node(cls, *extra):
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
            volunteer = cls(hub, host, identity, engine, *extra)
            await volunteer.join()
            return volunteer

        honest = await node(Volunteer)
        cheats = {
            name: await node(Cheat, choose)
            for name, choose in [("random", random_strings), ("greedy", greedy), ("edited", edited)]
        }

        while any(not c.banned() and c.sent < CAUGHT_WITHIN_GROUPS for c in cheats.values()):
            await honest.answer()
            for cheat in cheats.values():
                if not cheat.banned():
                    await cheat.answer_chosen()
        with trio.fail_after(60):  # the audits of groups sent before the ban are still running
            while not all(c.banned() for c in cheats.values()):
                await trio.sleep(0.05)
        for name, cheat in cheats.items():
            reason = hub.state.fleet.get(cheat.peer_id).banned_reason
            assert "sampling test" in reason and "nats" in reason, (name, reason)
            assert ("likelier" in reason) == (name == "greedy"), (name, reason)
            # Its passed audits never vouched for its pay while evidence gathered: the ban voided all of it.
            assert hub.state.totals.paid_usd.get(cheat.peer_id, 0.0) == 0.0, name
        assert hub.state.totals.paid_usd[honest.peer_id] > 0.0
        assert hub.state.fleet.get(honest.peer_id).state != "banned"
        status = hub.board.snapshot()
        events = hub.state.store.journal.events()
        for name, cheat in cheats.items():  # what the learner already took of its work stays learned, and is said
            (ban,) = [e for e in events if e.kind == "audit_fail" and e.node_id == cheat.peer_id]
            assert "groups was trained on" in ban.detail or "groups were trained on (step" in ban.detail, (name, ban)
        bar = status.sampling_threshold_nats
        assert bar is not None and bar > 30
        (mine,) = [n for n in status.nodes if n.peer_id == honest.peer_id]
        assert mine.sampling_nats < 0.5 * bar, mine.sampling_nats
    # `echo-hub status` names a node's evidence once it is more than chance, beside the bar.
    from hub.cli.status import _node_notes
    from shared.messages import short_id

    suspect = mine.model_copy(update={"sampling_nats": 0.5 * bar})
    notes = _node_notes(status.model_copy(update={"nodes": (suspect,)}))
    assert (
        f"sampling {short_id(mine.peer_id)}: evidence it chose its tokens {0.5 * bar:.1f} nats, condemned at {bar:.1f}" in notes
    )
    quiet = mine.model_copy(update={"sampling_nats": 0.05 * bar})  # what honest sampling shows by chance
    assert not [n for n in _node_notes(status.model_copy(update={"nodes": (quiet,)})) if n.startswith("sampling")]
