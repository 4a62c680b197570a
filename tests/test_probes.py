"""Probe back-off (hub/trust/probes.py) against hand-computed waits."""

from __future__ import annotations

from hub.trust.probes import PROBE_BACKOFF_MAX_S, ProbeStrikes, backoff_s

FIRST_S = 60.0  # the hub's default lease timeout


def test_the_wait_doubles_with_each_round_of_unanswered_probes_up_to_its_cap():
    assert [backoff_s(n, FIRST_S) for n in range(4)] == [0.0, 60.0, 120.0, 240.0]
    assert backoff_s(10**9, FIRST_S) == PROBE_BACKOFF_MAX_S


def test_an_address_passes_its_wait_to_fresh_identities_and_an_answer_clears_both():
    strikes = ProbeStrikes(FIRST_S)
    assert strikes.unanswered("a", "10.0.0.1", now=100.0) == 1
    assert strikes.unanswered("a", "10.0.0.1", now=200.0) == 2
    assert strikes.wait_s("a", "10.0.0.1", now=210.0) == 200.0 + 120.0 - 210.0
    assert strikes.wait_s("b", "10.0.0.1", now=210.0) == 110.0  # a fresh identity there
    assert strikes.wait_s("b", "10.0.0.2", now=210.0) == 0.0
    assert strikes.wait_s("a", None, now=210.0) == 110.0  # the identity's own wait
    strikes.answered("a", "10.0.0.1")
    assert strikes.wait_s("a", "10.0.0.1", now=210.0) == 0.0


def test_probes_expiring_within_a_running_wait_lengthen_it_once():
    strikes = ProbeStrikes(FIRST_S)
    for peer in "abcdefgh":  # eight identities of one address, leased together, expiring together
        strikes.unanswered(peer, "10.0.0.1", now=100.0)
    assert strikes.wait_s("z", "10.0.0.1", now=100.0) == 60.0
    strikes.unanswered("z", "10.0.0.1", now=160.0)  # the next round
    assert strikes.wait_s("y", "10.0.0.1", now=160.0) == 120.0


def test_throwaway_identities_do_not_grow_the_tables():
    strikes = ProbeStrikes(FIRST_S, table_size=4)
    for i in range(100):
        strikes.unanswered(f"peer{i}", f"10.0.{i}.1", now=float(i))
    assert strikes.wait_s("peer99", None, now=99.0) == 60.0
    assert strikes.wait_s("peer0", "10.0.0.1", now=99.0) == 0.0  # forgotten, the oldest first
    assert len(strikes._by_peer) == len(strikes._by_address) == 4
