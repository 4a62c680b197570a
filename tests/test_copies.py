"""Copy detection: repeated high-entropy groups are flagged, honest low-entropy repeats are not."""

from __future__ import annotations

import math
import random
import tracemalloc
from collections import OrderedDict

import pytest
import torch

from hub.trust.copies import ENTRY, RECORD, CopyDetector, Disputed, coincidence_log_prob, group_fingerprint
from shared.rollout import Completion, Group, SamplingParams
from shared.tasks.reverse import ReverseTask


def completion(tokens: tuple[int, ...], logprobs: tuple[float, ...]) -> Completion:
    return Completion(token_ids=tokens, logprobs=logprobs, finish_reason="stop", version=1, text="x")


def group(completions, pid: str = "p1") -> Group:
    return Group(
        prompt_id=pid,
        prompt_text="ab>",
        version=1,
        completions=tuple(completions),
        rewards=(0.0,) * len(completions),
        node_id="n",
    )


def test_repeat_surprise_by_hand():
    from hub.trust.copies import repeat_surprise

    # A whole group repeated: the multiset's orderings (3!/2!) times every occurrence's odds.
    assert repeat_surprise([2, 1], [-1.5, -2.5], [True, True]) == pytest.approx(-(math.log(3) - 5.5))
    # Two of eight shared (8 x 7 placements), the rest fresh: only those two count.
    assert repeat_surprise([1] * 8, [-10.0] * 8, [True, True] + [False] * 6) == pytest.approx(20 - math.log(56))
    # One completion twice, nothing shared: C(8, 2) places for the pair, the second draw's odds.
    assert repeat_surprise([2] + [1] * 6, [-10.0] * 7, [False] * 7) == pytest.approx(10 - math.log(28))


def test_the_copy_bar_is_the_run_wide_multiple_testing_one_by_hand():
    from hub.trust.copies import copy_threshold_nats

    # log(100,000 kept) + 8 log 2 (which completions are shared) + log(pi^2 / 6 / 1e-6) at the first group.
    first = math.log(1e5) + 8 * math.log(2) + math.log(math.pi**2 / 6 / 1e-6)
    assert copy_threshold_nats(1, 100_000, 8, 1e-6) == pytest.approx(first) == pytest.approx(31.4, abs=0.05)
    # The n-th group gets 6 alpha / (pi^2 n^2) of the rate: 2 log n more.
    assert copy_threshold_nats(10**6, 100_000, 8, 1e-6) == pytest.approx(first + 2 * math.log(1e6))
    assert sum(6 / (math.pi**2 * n**2) for n in range(1, 100_000)) < 1.0
    with pytest.raises(ValueError):
        copy_threshold_nats(0, 100_000, 8, 1e-6)


def test_coincidence_log_prob_by_hand():
    a = completion((5, 2), (-1.0, -0.5))
    b = completion((6, 2), (-2.0, -0.5))
    # Multiset {a, a, b}: 3!/(2!1!) = 3 orderings, each of probability e^-1.5 * e^-1.5 * e^-2.5.
    assert coincidence_log_prob(group([a, a, b])) == pytest.approx(math.log(3) - 5.5)
    # Eight copies of a near-certain completion: an honest repeat is almost sure.
    certain = completion((5, 2), (-1e-3, -1e-4))
    assert coincidence_log_prob(group([certain] * 8)) == pytest.approx(-8 * 1.1e-3)


def test_fingerprint_is_the_tokens_alone():
    a = completion((5, 7, 2), (-1.0, -2.0, -0.5))
    b = completion((6, 2), (-3.0, -0.5))
    base = group([a, b, b])
    assert group_fingerprint(base) == group_fingerprint(group([b, a, b], pid="other"))
    assert group_fingerprint(base) == group_fingerprint(base.model_copy(update={"version": 7}))
    # Nudged log-probs (the bypass of a fingerprint over exact floats) leave it unchanged...
    nudged = completion((6, 2), (-3.0, -0.5000001))
    assert group_fingerprint(base) == group_fingerprint(group([a, b, nudged]))
    # ...other tokens do not.
    assert group_fingerprint(base) != group_fingerprint(group([a, b, completion((6, 3), (-3.0, -0.5))]))


def with_tool_answer(c: Completion, answer: tuple[int, ...], at: int = 1) -> Completion:
    """`c` with a tool answer (environment tokens, log-prob 0.0) after its first `at` tokens."""
    return c.model_copy(
        update={
            "token_ids": (*c.token_ids[:at], *answer, *c.token_ids[at:]),
            "logprobs": (*c.logprobs[:at], *(0.0,) * len(answer), *c.logprobs[at:]),
            "env_spans": ((at, len(answer)),),
        }
    )


def test_environment_tokens_are_no_part_of_a_completions_digest_or_surprise():
    """A tool-using completion is judged on what the model sampled: the hub's tool answers neither make two
    completions differ nor add to a repeat's odds."""
    a = completion((5, 7, 2), (-1.0, -2.0, -0.5))
    b = completion((6, 2), (-3.0, -0.5))
    plain = group([a, b, b])
    answered = group([with_tool_answer(a, (9, 9, 1)), with_tool_answer(b, (8,)), with_tool_answer(b, (30, 31))])
    assert group_fingerprint(answered) == group_fingerprint(plain)
    assert coincidence_log_prob(answered) == pytest.approx(coincidence_log_prob(plain))
    # A copy whose tool answers differ (or that drops them) is still a copy, at the same surprise.
    seen = detector()
    original = diverse(5)
    assert seen.check(original, "nodeA", "L1") is None
    answers = original.model_copy(
        update={"completions": tuple(with_tool_answer(c, (11, 12 + i)) for i, c in enumerate(original.completions))}
    )
    flag = seen.check(answers, "nodeB", "L2")
    assert flag is not None and flag.exact and flag.repeated == 8
    plain_flag = detector()
    assert plain_flag.check(original, "nodeA", "L1") is None
    assert flag.surprise_nats == pytest.approx(plain_flag.check(original, "nodeB", "L2").surprise_nats)


def diverse(seed: int) -> Group:
    """Eight distinct completions of unlikely tokens: a repeat of them is no coincidence."""
    rng = random.Random(seed)
    # The seed's own token in each: groups of two seeds share no completion.
    return group([completion((rng.randrange(4, 40), 1000 + seed, 2), (-rng.uniform(9, 11), -0.1, -0.01)) for _ in range(8)])


def detector() -> CopyDetector:
    return CopyDetector(capacity=100, group_size=8, false_alarm=1e-6, logprob_tolerance_nats=0.05)


def test_a_copy_with_nudged_logprobs_is_still_flagged():
    seen = detector()
    original = diverse(1)
    assert seen.check(original, "nodeA", "L1") is None
    nudged = original.model_copy(
        update={
            "completions": tuple(
                c.model_copy(update={"logprobs": (c.logprobs[0] + 1e-7, *c.logprobs[1:])}) for c in original.completions
            )
        }
    )
    # The same prompt from another lease...
    assert seen.check(nudged, "nodeB", "L2") is not None
    # ...and another prompt, log-probs moved by less than an audit lets pass.
    moved = nudged.model_copy(
        update={
            "prompt_id": "p7",
            "prompt_text": "zz>",
            "completions": tuple(
                c.model_copy(update={"logprobs": (c.logprobs[0] - 0.04, *c.logprobs[1:])}) for c in original.completions
            ),
        }
    )
    assert seen.check(moved, "nodeC", "L3") is not None


def test_a_copy_that_claims_near_certain_tokens_is_judged_on_the_hubs_recompute():
    seen = detector()
    original = diverse(2)
    assert seen.check(original, "nodeA", "L1") is None
    # The copier reports its copy as near certain: on its own log-probs the repeat would look honest.
    certain = original.model_copy(
        update={"completions": tuple(c.model_copy(update={"logprobs": (-1e-9,) * len(c.logprobs)}) for c in original.completions)}
    )
    assert -coincidence_log_prob(certain) < 20.0
    # The first sighting's claims say otherwise: neither is believed, the hub recomputes...
    assert isinstance(seen.check(certain, "nodeB", "L2"), Disputed)
    # ...and the policy's own log-probs (here the original's, which were true) make it a copy.
    flag = seen.settle(certain, "nodeB", "L2", [sum(c.logprobs) for c in original.completions])
    assert flag is not None and flag.surprise_nats > 20.0
    # Without a recompute (its version left the shelf) the group is judged on its own claims, which replace nothing.
    assert seen.settle(certain, "nodeB", "L2", None) is None
    assert isinstance(seen.check(certain, "nodeC", "L3"), Disputed)


def test_copy_flagged_across_nodes_and_leases_not_on_first_sight():
    seen = detector()
    original = diverse(0)
    assert seen.check(original, "nodeA", "L1") is None
    flag = seen.check(original.model_copy(update={"prompt_id": "p9"}), "nodeB", "L2")
    assert flag is not None and not flag.same_node
    assert (flag.first.node_id, flag.again.node_id) == ("nodeA", "nodeB") and flag.surprise_nats > 20
    assert "nodeA's group" in flag.describe()
    # The same node answering another lease with work it already sold is a copy too.
    again = seen.check(original, "nodeA", "L3")
    assert again is not None and again.same_node


def test_honest_low_entropy_repeats_are_not_flagged(default_model_dir):
    """A peaked policy answers a repeated prompt identically: such repeats happen honestly and are not copies."""
    from node.hf_engine import HFEngine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine = HFEngine(default_model_dir)
    # Low temperature makes the tiny model near-deterministic, as a well-trained policy is on easy prompts.
    sampling = SamplingParams(temperature=0.1, top_p=1.0, max_new_tokens=10)
    prompts = ReverseTask().sample(random.Random(4), 6)
    detector = CopyDetector(capacity=1000, group_size=8, false_alarm=1e-6, logprob_tolerance_nats=0.05)
    # Two honest nodes get the same prompts (prompts are drawn with replacement) in separate leases.
    batches = [engine.generate([p.text for p in prompts], 8, sampling) for _ in range(2)]
    fingerprints: list[set[bytes]] = []
    for lease, batch in zip(("LA", "LB"), batches):
        fingerprints.append(set())
        for prompt, completions in zip(prompts, batch):
            g = Group(
                prompt_id=prompt.id,
                prompt_text=prompt.text,
                version=0,
                completions=tuple(completions),
                rewards=(0.0,) * 8,
                node_id=lease,
            )
            fingerprints[-1].add(group_fingerprint(g))
            assert detector.check(g, lease, lease) is None
    assert len(fingerprints[0] & fingerprints[1]) >= 3, "expected identical honest groups on a peaked model"
    # Every check above returned None: the repeats were seen (the fingerprints match) and judged honest.


def test_lru_is_bounded():
    detector = CopyDetector(capacity=3, group_size=2, false_alarm=1e-6, logprob_tolerance_nats=0.05)
    groups = [
        group([completion((10 + i, 2), (-15.0, -1.0)), completion((10 + i, 3), (-15.0, -1.0))], pid=f"p{i}") for i in range(5)
    ]
    for i, g in enumerate(groups):
        assert detector.check(g, "n", f"L{i}") is None
    assert len(detector) == 3
    # The oldest were evicted: repeating them is not detected any more, the newest are.
    assert detector.check(groups[0], "m", "L9") is None
    assert detector.check(groups[4], "m", "L9") is not None


def test_cross_prompt_repeats_need_matching_logprobs_and_odds_beyond_the_run_wide_bar():
    seen = detector()
    likely = group([completion((5, 2), (-1.6, -0.1)), completion((6, 2), (-1.7, -0.1))] * 4)  # odds ~e^-10
    assert seen.check(likely, "nodeA", "L1") is None
    # The same prompt again: an honest redraw at e^-10 is far below the run's bar.
    assert seen.check(likely.model_copy(update={"prompt_id": "p2"}), "nodeB", "L2") is None
    # Under another prompt text, with the same log-probs: a model that ignores its prompt draws it at e^-10, which a
    # run of many groups sees honestly. No copy.
    assert seen.check(likely.model_copy(update={"prompt_id": "p3", "prompt_text": "xyz>"}), "nodeB", "L3") is None
    # Unlikely completions (odds ~e^-33) with the same log-probs under another prompt text were not sampled there.
    unlikely = group([completion((15, 2), (-4.6, -0.1)), completion((16, 2), (-4.7, -0.1))] * 4)
    assert seen.check(unlikely, "nodeA", "L7") is None
    moved = unlikely.model_copy(update={"prompt_id": "p3", "prompt_text": "xyz>"})
    flag = seen.check(moved, "nodeB", "L8")
    assert flag is not None and seen.threshold_nats <= flag.surprise_nats < 40.0
    # Another prompt with its own log-probs for the same tokens (a model that ignores the prompt) is honest.
    own = moved.model_copy(
        update={
            "prompt_id": "p4",
            "prompt_text": "qrs>",
            "completions": tuple(
                c.model_copy(update={"logprobs": (c.logprobs[0] - 0.5, c.logprobs[1])}) for c in unlikely.completions
            ),
        }
    )
    assert seen.check(own, "nodeC", "L4") is None
    # Near-certain groups repeat anywhere honestly: never flagged across prompts.
    certain = group([completion((5, 2), (-1e-3, -1e-4))] * 8)
    assert seen.check(certain, "nodeA", "L5") is None
    assert seen.check(certain.model_copy(update={"prompt_id": "p9", "prompt_text": "xyz>"}), "nodeB", "L6") is None


def test_the_table_keeps_exactly_the_least_recently_used_through_collisions_and_evictions():
    """Hundreds of groups through a 16-slot detector (a 32-position table: probe runs collide and wrap), repeats of
    random earlier ones refreshing them: a repeat is flagged exactly when an LRU of 16 would still hold it."""
    detector = CopyDetector(capacity=16, group_size=8, false_alarm=1e-6, logprob_tolerance_nats=0.05)
    lru: OrderedDict[int, None] = OrderedDict()
    rng = random.Random(3)
    flagged, sent = 0, []
    for i in range(600):
        seed = rng.choice(sent[-24:]) if sent and rng.random() < 0.4 else i + 1000
        sent.append(seed)
        flag = detector.check(diverse(seed), "nodeA", f"L{i}")
        assert (flag is not None) == (seed in lru), f"check {i}: group {seed}"
        flagged += flag is not None
        lru[seed] = None
        lru.move_to_end(seed)
        while len(lru) > 16:
            lru.popitem(last=False)
        assert len(detector) == len(lru)
    assert flagged > 20


def test_kept_groups_cost_no_python_memory():
    """The records live in mappings: two thousand more groups kept add nothing to Python's heap (a dict of small
    objects per group took ~0.6 KB each, and pinned its allocator's arenas for as long as any of them lived)."""
    detector = CopyDetector(capacity=5000, group_size=8, false_alarm=1e-6, logprob_tolerance_nats=0.05)
    groups = [diverse(seed) for seed in range(4000)]
    tracemalloc.start()
    try:
        # Warm under the tracer: the interpreter's free lists (of tuples, floats) then hold traced objects (~0.1 MB
        # once, within the first 2,000 groups).
        for i, g in enumerate(groups[:2000]):
            detector.check(g, "nodeA", f"W{i}")
        before, _ = tracemalloc.get_traced_memory()
        for i, g in enumerate(groups[2000:]):
            assert detector.check(g, "nodeA", f"M{i}") is None
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(detector) == 4000
    assert grown < 20_000, f"{grown} bytes of Python objects for 2,000 more groups kept"
    assert detector.reserved_bytes <= 5000 * (RECORD.size + 8 * ENTRY.size + 8) + 4 * (16384 + 2 * 131072)


def test_long_names_are_cut_in_the_record_but_compared_whole():
    detector = CopyDetector(capacity=10, group_size=8, false_alarm=1e-6, logprob_tolerance_nats=0.05)
    long_node = "12D3KooW" + "x" * 120
    original = diverse(5).model_copy(update={"prompt_id": "p" * 150 + "é"})
    assert detector.check(original, long_node + "A", "L1") is None
    # Another node whose id differs only past the kept width is still another node.
    flag = detector.check(original.model_copy(update={"prompt_id": "p2"}), long_node + "B", "L2")
    assert flag is not None and not flag.same_node
    assert flag.first.node_id == long_node[:64] and flag.first.prompt_id == "p" * 48
    assert flag.describe().startswith("group for p2 (lease L2) repeats 12D3KooW")
    # Same lease and prompt id (the long one) again: not a copy, whatever the width kept.
    assert detector.check(original, long_node + "A", "L1") is None


def confident(pid: str = "p1", claimed: float = -1e-3) -> Group:
    """What a collapsed policy answers every time: eight times the same completion, claiming `claimed` per token."""
    return group([completion((7, 8, 9, 2), (claimed,) * 4)] * 8, pid=pid)


def test_a_throwaway_identity_cannot_get_honest_repeats_refused():
    """The round-four framing: an attacker submits the group a confident policy produces, claiming low log-probs for
    it. Claiming -3 nats a token, its own group is refused (eight draws that unlikely are no honest group); claiming
    just little enough to pass, an honest repeat (claiming what the policy gives, near 0) is recomputed rather than
    judged on the attacker's claim, accepted, and the hub's figures then stand: later repeats need no recompute.
    (The bar here: 24.5 nats at the first check, 25.9 at the second, 26.7 at the third; 0.86 a token is 3.44 a
    completion, 24.1 for seven, 27.5 for eight.)"""
    seen = detector()
    flag = seen.check(confident(claimed=-3.0), "attacker", "L0")
    assert flag is not None and "duplicates its own completions" in flag.describe()
    assert len(seen) == 0
    assert seen.check(confident(claimed=-0.86), "attacker", "L0") is None  # 7 x 3.44 nats: under the bar
    honest = confident(pid="p2")
    assert isinstance(seen.check(honest, "honest1", "L1"), Disputed)  # 8 x 3.44 nats on the attacker's claim
    assert seen.settle(honest, "honest1", "L1", [-4e-3] * 8) is None
    for i in range(3):
        assert seen.check(confident(pid=f"p{3 + i}"), f"honest{2 + i}", f"L{2 + i}") is None
    # Banned, its sightings are forgotten: its claims are no evidence against anyone, recomputed or not.
    fresh = detector()
    assert fresh.check(confident(claimed=-0.86), "attacker", "L0") is None
    assert fresh.forget("attacker") == 1 and len(fresh) == 0
    assert fresh.check(confident(pid="p2"), "honest1", "L1") is None
    assert fresh.forget("attacker") == 0 and len(fresh) == 1


def test_forgotten_slots_are_reused_and_the_rest_still_found():
    seen = CopyDetector(capacity=8, group_size=8, false_alarm=1e-6, logprob_tolerance_nats=0.05)
    for i in range(8):
        assert seen.check(diverse(i), "bad" if i % 2 else "good", f"L{i}") is None
    assert seen.forget("bad") == 4 and len(seen) == 4
    for i in range(8, 12):  # into the forgotten slots: nothing good is evicted
        assert seen.check(diverse(i), "good", f"L{i}") is None
    assert len(seen) == 8
    for i in (0, 2, 4, 6, 8, 11):
        assert seen.check(diverse(i), "copier", f"C{i}") is not None
    assert seen.check(diverse(1), "copier", "C1") is None  # the banned node's group: forgotten


def test_near_copies_are_caught_per_completion():
    """A genuine group replayed with one or two completions replaced by duplicates of others (round four: accepted,
    paid and audited with no new sampling), a group made of one completion sold eight times, and completions
    replayed from an earlier group into a new one: refused; an honest group sharing a likely completion is not."""
    seen = detector()
    original = diverse(7)
    assert seen.check(original, "honest", "L1") is None
    c = original.completions
    for replaced in ((c[0], c[0], *c[2:]), (c[0], c[0], *c[2:7], c[2])):
        flag = seen.check(group(replaced, pid="p2"), "copier", "L2")
        assert flag is not None and flag.repeated == 8 and "repeats 8 of 8 completions of honest's group" in flag.describe()
    assert "repeats honest's group" in seen.check(original.model_copy(update={"prompt_id": "p9"}), "copier", "L9").describe()
    # Half of a longer group (completions of ~9 nats) replayed beside four fresh completions of its own.
    longer = group([completion((40 + i, 41 + i, 2), (-4.5, -4.5, -0.01)) for i in range(8)], pid="p5")
    assert seen.check(longer, "honest", "L7") is None
    fresh = diverse(8).completions[:4]
    flag = seen.check(group((*longer.completions[:4], *fresh), pid="p3"), "copier", "L3")
    assert flag is not None and flag.repeated == 4 and flag.surprise_nats >= 20
    # One sampled completion sold eight times: no earlier group needed.
    flag = seen.check(group([diverse(9).completions[0]] * 8, pid="p4"), "copier", "L4")
    assert flag is not None and flag.first is flag.again and "duplicates its own completions (7 of 8)" in flag.describe()
    # An honest group that happens to share one likely completion (the same short answer) is no copy.
    likely = completion((3, 2), (-0.5, -0.01))
    assert seen.check(group([likely, *diverse(10).completions[1:]]), "honest", "L5") is None
    assert seen.check(group([likely, *diverse(11).completions[1:]]), "other", "L6") is None


def test_completions_replayed_under_another_prompt_with_their_log_probs_are_caught():
    """Part of a genuine group replayed as the answer to another prompt, beside fresh completions: the same tokens
    with the same log-probs were not sampled there. With its own log-probs (a model that ignores the prompt) or
    near-certain tokens, it is no copy."""
    seen = detector()
    longer = group([completion((40 + i, 41 + i, 2), (-4.5, -4.5, -0.01)) for i in range(8)])
    assert seen.check(longer, "honest", "L1") is None
    elsewhere = {"prompt_id": "p2", "prompt_text": "zz>"}
    replayed = group((*longer.completions[:5], *diverse(3).completions[:3])).model_copy(update=elsewhere)
    flag = seen.check(replayed, "copier", "L2")
    assert flag is not None and flag.repeated == 5 and "repeats 5 of 8 completions of honest's group" in flag.describe()
    own = replayed.model_copy(
        update={
            "completions": tuple(
                c.model_copy(update={"logprobs": (c.logprobs[0] - 0.5, *c.logprobs[1:])}) for c in replayed.completions
            )
        }
    )
    assert seen.check(own.model_copy(update={"prompt_id": "p3"}), "other", "L3") is None
    certain = group([completion((60 + i, 2), (-1e-3, -1e-4)) for i in range(8)])
    assert seen.check(certain, "nodeA", "L4") is None
    assert seen.check(certain.model_copy(update=elsewhere), "nodeB", "L5") is None


def test_a_collapsed_policy_repeats_itself_honestly_across_versions():
    """The trial's collapse (every answer the same): first seen while the policy was less sure (claims e^-27.5 for
    the group), then repeated by every node with log-probs near 0. The claims disagree, the hub's recompute at the
    repeat's version agrees with the repeat: accepted, and from then on repeats are accepted outright."""
    seen = detector()
    assert seen.check(confident(claimed=-0.86), "nodeA", "L0") is None
    repeat = confident(pid="p2")
    assert isinstance(seen.check(repeat, "nodeB", "L1"), Disputed)
    assert seen.settle(repeat, "nodeB", "L1", [-4e-3] * 8) is None
    for i in range(20):
        assert seen.check(confident(pid=f"q{i}"), f"node{i % 4}", f"M{i}") is None


class TwoPromptTask(ReverseTask):
    """Two words: leases keep drawing the same prompt texts, as a small task or a long run does."""

    def __init__(self) -> None:
        super().__init__(size=2)


class Volunteer:
    """A node on loopback: joins the in-process hub, leases, answers with the real engine (its claims rewritten by
    `claim`, when it lies), submits, and keeps what the hub decided."""

    def __init__(self, hub, host, identity, engine) -> None:
        from node.client import HubClient

        self.hub, self.engine = hub, engine
        self.client = HubClient(host, identity, hub.addr, timeout_s=30)
        self.peer_id = identity.peer_id
        self.copies_refused = 0
        self.groups: list[Group] = []

    async def join(self) -> None:
        from shared.messages import JoinReply, JoinRequest

        await self.client.connect()
        reply = await self.client.join(
            JoinRequest(
                price_per_hour=0.5,
                hardware="test",
                link_bps=1e8,
                backend="hf",
                dtype="float32",
                model_config_hash=self.hub.config_hash,
                version_held=0,
            )
        )
        assert isinstance(reply, JoinReply), reply

    async def lease(self):
        """A lease; a node that just joined is in standby until the hub's scheduler activates it: ask until it is."""
        import trio

        from shared.messages import LeaseReply

        with trio.fail_after(30):
            while True:
                reply = await self.client.lease(0)
                assert isinstance(reply, LeaseReply), reply
                if reply.lease is not None:
                    return reply.lease
                await trio.sleep(0.05)

    async def answer(self, claim=None) -> int:
        """One lease answered; how many of its groups were accepted."""
        import trio

        from shared.messages import Submission, SubmitReply, SubmittedGroup

        lease = await self.lease()
        batches = await trio.to_thread.run_sync(
            self.engine.generate, [p.text for p in lease.prompts], lease.group_size, lease.sampling
        )
        groups = []
        for prompt, completions in zip(lease.prompts, batches):
            if claim is not None:
                completions = [c.model_copy(update={"logprobs": claim(c)}) for c in completions]
            groups.append(SubmittedGroup(prompt_id=prompt.prompt_id, completions=tuple(completions)))
            self.groups.append(
                Group(
                    prompt_id=prompt.prompt_id,
                    prompt_text=prompt.text,
                    version=0,
                    completions=tuple(completions),
                    rewards=(0.0,) * len(completions),
                    node_id="n",
                )
            )
        answer = await self.client.submit(Submission(lease_id=lease.lease_id, node_id=self.peer_id, groups=tuple(groups)))
        assert isinstance(answer, SubmitReply), answer
        self.copies_refused += sum(reason == "copy of an earlier group" for _, reason in answer.rejected)
        return answer.accepted


@pytest.mark.trio
async def test_a_collapsed_policy_served_by_honest_nodes_after_a_framing_attempt_is_never_refused(tmp_path, default_model_dir):
    """A real hub on loopback, its policy collapsed (the tiny model at temperature 0.05: every answer the same): a
    throwaway identity first submits the groups that policy produces, claiming them just likely enough to be
    accepted and unlikely enough that honest repeats look like copies on its word (on the code before: 3 of 3
    refused). Three honest nodes then serve the same prompts: none of their groups is refused as a copy, the
    throwaway's sightings are forgotten once it is banned, and a near-copy of an honest group is still refused."""
    from contextlib import AsyncExitStack

    from hub.config import HubConfig, LearnerConfig, LeaseConfig
    from node.hf_engine import HFEngine
    from shared.crypto import Identity
    from shared.net import running_host
    from testbed.inproc import LOOPBACK, PERMISSIVE_TRUST, inproc_hub

    torch.manual_seed(0)
    config = HubConfig(
        task=f"{__name__}:TwoPromptTask",
        learner=LearnerConfig(staleness=2, prompts_per_step=8, group_size=8),
        lease=LeaseConfig(prompts_per_lease=1),
        trust=PERMISSIVE_TRUST,
        sampling=SamplingParams(temperature=0.05, top_p=1.0, max_new_tokens=10),
    )
    engine = HFEngine(default_model_dir)
    async with inproc_hub(tmp_path, default_model_dir, config, real_weights=True) as hub, AsyncExitStack() as stack:

        async def volunteer() -> Volunteer:
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
            node = Volunteer(hub, host, identity, engine)
            await node.join()
            return node

        attacker = await volunteer()
        copies = hub.state.intake.copies

        def framing(c: Completion) -> tuple[float, ...]:
            """Just under a seventh of the bar a completion: seven duplicates (its own group) stay under the bar the
            next check is judged at (it only rises), eight repeats pass it for the next few checks."""
            return (-(copies.threshold_nats / 7 - 0.1) / len(c.token_ids),) * len(c.token_ids)

        framed = 0
        while framed < 2:
            framed += await attacker.answer(claim=framing)
        honest = [await volunteer() for _ in range(3)]
        for _ in range(3):
            for node in honest:
                await node.answer()
        assert [node.copies_refused for node in honest] == [0, 0, 0]
        framed_prints = {group_fingerprint(g) for g in attacker.groups}
        repeats = sum(group_fingerprint(g) in framed_prints for node in honest for g in node.groups)
        assert repeats >= 3, "the honest nodes were expected to repeat the framed groups"

        kept = len(hub.state.intake.copies)
        await hub.state.membership.ban(hub.state.fleet.get(attacker.peer_id), "test: the throwaway identity")
        assert len(hub.state.intake.copies) < kept
        for node in honest:
            await node.answer()
        assert [node.copies_refused for node in honest] == [0, 0, 0]


@pytest.mark.trio
async def test_near_copies_of_honest_groups_are_refused_on_a_real_hub(tmp_path, default_model_dir):
    """A real hub on loopback, a policy with real randomness (a random-weight model at temperature 1): a copier that
    answers its lease with an honest node's group, one or two of its completions replaced by duplicates of others
    (round four: accepted and paid), is refused as a copy; the honest node never is."""
    from contextlib import AsyncExitStack

    from hub.config import HubConfig, LearnerConfig, LeaseConfig
    from node.hf_engine import HFEngine
    from shared.crypto import Identity
    from shared.messages import Submission, SubmitReply, SubmittedGroup
    from shared.net import running_host
    from testbed.inproc import LOOPBACK, PERMISSIVE_TRUST, inproc_hub
    from testbed.models import random_model_dir

    torch.manual_seed(0)
    model = random_model_dir(tmp_path / "model", "qwen2", hidden=64, layers=2)
    config = HubConfig(
        task=f"{__name__}:TwoPromptTask",
        learner=LearnerConfig(staleness=2, prompts_per_step=8, group_size=8),
        lease=LeaseConfig(prompts_per_lease=1),
        trust=PERMISSIVE_TRUST,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10),
    )
    engine = HFEngine(model)
    async with inproc_hub(tmp_path / "hub", model, config, real_weights=True) as hub, AsyncExitStack() as stack:

        async def volunteer() -> Volunteer:
            identity = Identity.generate()
            host, _ = await stack.enter_async_context(running_host(identity, [LOOPBACK]))
            node = Volunteer(hub, host, identity, engine)
            await node.join()
            return node

        honest, copier = await volunteer(), await volunteer()
        while len({g.prompt_text for g in honest.groups}) < 2:  # both prompts answered: any lease can be copied
            assert await honest.answer() == 1
        refused = []
        for replace in ((0,), (0, 5)):
            lease = await copier.lease()
            source = next(g for g in honest.groups if g.prompt_text == lease.prompts[0].text)
            completions = list(source.completions)
            for i in replace:
                completions[i] = completions[i + 1]
            answer = await copier.client.submit(
                Submission(
                    lease_id=lease.lease_id,
                    node_id=copier.peer_id,
                    groups=(SubmittedGroup(prompt_id=lease.prompts[0].prompt_id, completions=tuple(completions)),),
                )
            )
            assert isinstance(answer, SubmitReply), answer
            refused += [reason for _, reason in answer.rejected]
        assert refused == ["copy of an earlier group"] * 2
        for _ in range(2):
            await honest.answer()
        assert honest.copies_refused == 0
