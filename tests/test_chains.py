"""Chain planning and ideal broadcast times against hand-computed values."""

from __future__ import annotations

import random

import pytest

from hub.method.chains import (
    chain_ideal_s,
    chained_broadcast_ideal_s,
    num_chains,
    plan_chains,
    proven_first,
    relay_too_slow,
    relink_after_leave,
    star_ideal_s,
)


def test_num_chains():
    assert num_chains(100.0, 30.0) == 3
    assert num_chains(250.0, 100.0) == 2
    assert num_chains(100.0, 100.0) == 1
    assert num_chains(50.0, 100.0) == 1
    assert num_chains(100.0, 30.0, max_chains=2) == 2
    # A declared Bw as small as a float gets (the attack of one hostile join): capped, not an overflow.
    assert num_chains(1e12, 5e-324, max_chains=3) == 3
    with pytest.raises(ValueError, match="bandwidths"):
        num_chains(0.0, 1.0)


def test_plan_chains_fastest_first_slow_at_tails():
    nodes = [("d", 30.0), ("b", 50.0), ("c", 100.0), ("a", 100.0), ("e", 80.0)]
    # Bw = 30, N_ch = floor(100 / 30) = 3; fastest-first order a, c (tie by name), e, b, d dealt round-robin
    assert plan_chains(nodes, 100.0) == [["a", "b"], ["c", "d"], ["e"]]


def test_plan_chains_never_more_chains_than_nodes():
    assert plan_chains([("b", 100.0), ("a", 100.0)], 1000.0) == [["a"], ["b"]]


def test_plan_chains_single_chain_when_hub_is_slow():
    assert plan_chains([("a", 10.0), ("b", 20.0), ("c", 15.0)], 5.0) == [["b", "c", "a"]]


def test_plan_chains_empty():
    assert plan_chains([], 100.0) == []


def test_plan_chains_lengths_balanced_and_complete():
    rng = random.Random(7)
    for n in range(1, 25):
        nodes = [(f"n{i}", rng.uniform(10.0, 100.0)) for i in range(n)]
        hub = rng.uniform(5.0, 600.0)
        chains = plan_chains(nodes, hub)
        expected = min(n, max(1, int(hub // min(link for _, link in nodes))))
        assert len(chains) == expected
        lengths = [len(chain) for chain in chains]
        assert max(lengths) - min(lengths) <= 1
        assert sorted(name for chain in chains for name in chain) == sorted(name for name, _ in nodes)
        assert plan_chains(list(reversed(nodes)), hub) == chains


def test_plan_chains_errors():
    with pytest.raises(ValueError, match="duplicate"):
        plan_chains([("a", 1.0), ("a", 2.0)], 10.0)
    with pytest.raises(ValueError, match="link bandwidth"):
        plan_chains([("a", 0.0)], 10.0)


def test_relink_after_leave():
    chains = [["a", "b", "d"], ["c"]]
    assert relink_after_leave(chains, "b") == [["a", "d"], ["c"]]
    assert relink_after_leave(chains, "a") == [["b", "d"], ["c"]]
    assert relink_after_leave(chains, "c") == [["a", "b", "d"]]
    assert chains == [["a", "b", "d"], ["c"]]
    with pytest.raises(ValueError, match="in no chain"):
        relink_after_leave(chains, "x")


def test_chain_ideal():
    # 1000 / 100 + 4 * 10 / 100
    assert chain_ideal_s(1000.0, 10.0, 5, 100.0) == pytest.approx(10.4)
    assert chain_ideal_s(1000.0, 10.0, 1, 100.0) == pytest.approx(10.0)


def test_chained_broadcast_ideal():
    # N_ch = floor(250 / 100) = 2, longest chain ceil(9 / 2) = 5 at Bw = 100
    assert chained_broadcast_ideal_s(1000.0, 10.0, 9, 250.0, 100.0) == pytest.approx(10.4)
    # hub slower than a node link: one chain of 3 at B0 = 50: 1000 / 50 + 2 * 10 / 50
    assert chained_broadcast_ideal_s(1000.0, 10.0, 3, 50.0, 100.0) == pytest.approx(20.4)


def test_star_ideal():
    # B0 / N = 800 / 9 < 100: hub-bound, 9 * 1000 / 800
    assert star_ideal_s(1000.0, 9, 800.0, 100.0) == pytest.approx(11.25)
    # B0 / N = 200 > 100: node-link bound
    assert star_ideal_s(1000.0, 4, 800.0, 100.0) == pytest.approx(10.0)


def test_link_kind_says_who_dials_whom():
    from hub.method.chains import link_kind

    assert link_kind(None, "nated") == "hub"  # a chain head pulls from the hub
    assert link_kind("public", "nated") == "direct" and link_kind("public", "unknown") == "direct"
    # Nobody is told an address the hub's dial-back has not confirmed: a node not probed yet is dialed by nobody.
    assert link_kind("unknown", "public") == "hub" and link_kind("unknown", "nated") == "hub"
    assert link_kind("nated", "unknown") == "hub"
    assert link_kind("nated", "public") == "pushed"  # the NATed upstream dials its dialable successor
    assert link_kind("nated", "nated") == "holepunch"  # neither can dial alone: both dial at once (node/nat.py)


def test_a_dialable_node_goes_between_two_nated_ones():
    from hub.method.chains import separate_nated

    reach = {"a": "nated", "b": "nated", "c": "nated", "p": "public", "q": "public"}
    assert separate_nated(["a", "b", "p"], reach) == ["a", "p", "b"]
    assert separate_nated(["p", "a", "b"], reach) == ["a", "p", "b"]
    assert separate_nated(["a", "b", "c", "p", "q"], reach) == ["a", "p", "b", "q", "c"]
    # Not enough dialable nodes: as many pairs split as they allow, the rest left in order.
    assert separate_nated(["a", "b", "c", "p"], reach) == ["a", "p", "b", "c"]
    # A dialable node between two NATed ones stays there; nothing to do without NATed pairs.
    assert separate_nated(["a", "p", "b"], reach) == ["a", "p", "b"]
    assert separate_nated(["p", "q"], reach) == ["p", "q"]


def test_relay_too_slow_below_a_quarter_of_the_smaller_of_link_and_hub_over_four_chunks():
    # Link 1 MB/s, hub 400 kB/s: the bound is 400e3 / 4 = 100 kB/s. With 10 kB chunks and a report 2 s late, the
    # bound owes 100e3 * (2.25 - 2) = 25 kB at 2.25 s: under 4 chunks, too small a sample to judge even nothing.
    assert not relay_too_slow(0.0, 2.25, 2.0, 1e6, 4e5, 1e4)
    # At 2.5 s it owes 50 kB: 30 kB (+ 10 kB that may be in flight) falls short, 40 kB does not.
    assert relay_too_slow(3e4, 2.5, 2.0, 1e6, 4e5, 1e4)
    assert not relay_too_slow(4e4, 2.5, 2.0, 1e6, 4e5, 1e4)
    # A link declared at 200 kB/s, under the hub's pace, sets the bound: 50 kB/s owes 25 kB at 2.5 s (not judged)
    # and 100 kB at 4 s, which 80 kB misses and 90 kB meets.
    assert not relay_too_slow(0.0, 2.5, 2.0, 2e5, 4e5, 1e4)
    assert relay_too_slow(8e4, 4.0, 2.0, 2e5, 4e5, 1e4)
    assert not relay_too_slow(9e4, 4.0, 2.0, 2e5, 4e5, 1e4)


def test_relay_too_slow_at_the_issues_numbers():
    """Issue 65: 1 MiB chunks, the hub's pace 5 MiB in 1.16 s = 4,519,724 B/s, links declared at 1000 Mbit/s, reports
    up to 2 heartbeats of 2 s late. The bound: 4,519,724 / 4 = 1,129,931 B/s; it owes 4 chunks (4,194,304 B) once
    1,129,931 * (t - 4) >= 4,194,304, at t = 7.71 s."""
    mib, hub_bps, declared_bps = 1 << 20, 5 * (1 << 20) / 1.16, 125e6
    # At 7.5 s it owes 3,954,759 B: not judged yet.
    assert not relay_too_slow(0.0, 7.5, 4.0, declared_bps, hub_bps, mib)
    # At 8 s it owes 4,519,724 B: a relay that sent 1 MiB per 12 s (1 MiB, + 1 MiB in flight) is too slow.
    assert relay_too_slow(mib, 8.0, 4.0, declared_bps, hub_bps, mib)
    # A slow honest relay at 30% of the hub's pace (1,355,917 B/s) had 4 s * 1,355,917 = 5.4 MB reported: 5 chunks.
    assert not relay_too_slow(5 * mib, 8.0, 4.0, declared_bps, hub_bps, mib)


def test_proven_nodes_come_first_in_each_chain_and_each_part_keeps_its_order():
    chains = [["x1", "a", "x2", "b"], ["x3"], ["c", "x4"]]
    assert proven_first(chains, {"a", "b", "c"}) == [["a", "b", "x1", "x2"], ["x3"], ["c", "x4"]]
    assert proven_first(chains, set()) == chains
