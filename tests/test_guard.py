"""Sybil and resource limits: lease quotas per identity and address, per-peer stream/rate/memory caps."""

from __future__ import annotations

from collections import Counter

import pytest

from hub.config import TrustConfig
from hub.trust.guard import LeaseQuota, PeerGuard
from shared.net import address_key

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_address_key_groups_ipv6_by_64():
    assert address_key("203.0.113.7") == "203.0.113.7"
    assert address_key("2001:db8:1:2::1") == address_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:198.51.100.4") == "198.51.100.4"
    assert address_key(None) is None


def decide(quota: LeaseQuota, peer: str, ip: str, open_leases: list[tuple[str, str]], exempt=frozenset()):
    """The quota's answer with `open_leases` (holder, holder ip) open, counted as the lease book counts them."""
    by_address = Counter(address_key(ip_) for holder, ip_ in open_leases if holder not in exempt)
    return quota.decide(peer, ip, 5, sum(holder == peer for holder, _ in open_leases), by_address, exempt)


def test_new_identity_gets_small_leases_until_trusted():
    quota = LeaseQuota(TrustConfig(lease_new_node_prompts=1, trusted_after_audits=3), prompts_per_lease=4)
    assert [quota.decide("A", "10.0.0.1", k, 0, {}).prompts for k in range(5)] == [1, 1, 1, 4, 4]


def test_quota_per_peer_and_per_address():
    quota = LeaseQuota(TrustConfig(max_open_leases_per_peer=2, max_open_leases_per_ip=3), prompts_per_lease=4)
    open_leases = [("A", "10.0.0.1"), ("A", "10.0.0.1")]
    assert not decide(quota, "A", "10.0.0.1", open_leases).allowed
    assert decide(quota, "B", "10.0.0.1", open_leases).allowed
    # Sybils behind one address share its quota: a third identity there is refused.
    open_leases.append(("B", "10.0.0.1"))
    refused = decide(quota, "C", "10.0.0.1", open_leases)
    assert not refused.allowed and "10.0.0.1" in refused.reason
    assert decide(quota, "D", "10.0.0.2", open_leases).allowed
    # Same for identities spread over one IPv6 /64.
    v6 = [("E", "2001:db8::1"), ("F", "2001:db8::2"), ("G", "2001:db8::3")]
    assert not decide(quota, "H", "2001:db8::4", v6).allowed
    # Loopback is an address like any other: Sybils on the hub's machine share its quota...
    local = [("L1", "127.0.0.1"), ("L2", "127.0.0.1"), ("L3", "127.0.0.1")]
    assert not decide(quota, "X", "127.0.0.1", local).allowed
    # ...but the nodes the hub spawned itself are named exempt: they neither use nor count against it.
    mine = {"L1", "L2", "L3", "L4"}
    assert decide(quota, "L4", "127.0.0.1", local, exempt=mine).allowed
    assert decide(quota, "X", "127.0.0.1", local, exempt=mine).allowed


def test_honest_peer_pattern_is_never_refused():
    """Heartbeat every 2 s, a lease + submit pair per second, one snapshot fetch: nothing refused in 10 minutes."""
    clock = Clock()
    guard = PeerGuard(TrustConfig(), clock)
    for tick in range(600):
        admissions = [guard.admit("honest", 4096) for _ in range(3 if tick % 2 == 0 else 2)]
        if tick % 60 == 0:
            admissions.append(guard.admit("honest", 33 * MIB))
        assert all(a.admitted for a in admissions)
        for a in admissions:
            guard.release("honest", a)
        clock.now += 1.0
    assert guard.buffered_bytes == 0


def test_rate_limit_throttles_then_disconnects_then_recovers():
    clock = Clock()
    cfg = TrustConfig(
        requests_per_s=10.0, request_burst=5, violations_to_disconnect=4, violation_window_s=10.0, disconnect_cooldown_s=60.0
    )
    guard = PeerGuard(cfg, clock)
    for _ in range(5):
        guard.release("flood", guard.admit("flood", 0))
    throttled = guard.admit("flood", 0)
    assert throttled.verdict == "throttle" and throttled.retry_after_s == pytest.approx(0.1)
    assert guard.admit("other", 0).admitted  # another peer is unaffected
    assert [guard.admit("flood", 0).verdict for _ in range(3)] == ["throttle", "throttle", "disconnect"]
    clock.now += 30.0  # bucket full again, but the cooldown runs
    assert guard.admit("flood", 0).verdict == "disconnect"
    clock.now += 31.0
    assert guard.admit("flood", 0).admitted


def test_violations_outside_the_window_are_forgotten():
    clock = Clock()
    guard = PeerGuard(TrustConfig(requests_per_s=1.0, request_burst=1, violations_to_disconnect=3, violation_window_s=5.0), clock)
    for _ in range(10):
        guard.release("p", guard.admit("p", 0))
        assert guard.admit("p", 0).verdict == "throttle"  # one violation every 6 s never reaches 3 in 5 s
        clock.now += 6.0


def test_concurrent_stream_cap():
    clock = Clock()
    guard = PeerGuard(TrustConfig(max_streams_per_peer=3), clock)
    held = [guard.admit("p", 0) for _ in range(3)]
    assert all(a.admitted for a in held)
    refused = guard.admit("p", 0)
    assert refused.verdict == "throttle" and "streams" in refused.reason
    guard.release("p", held.pop())
    assert guard.admit("p", 0).admitted


def test_buffered_bytes_caps_per_peer_and_total():
    clock = Clock()
    cfg = TrustConfig(max_buffered_bytes_per_peer=64 * MIB, max_buffered_bytes_total=100 * MIB)
    guard = PeerGuard(cfg, clock)
    a1 = guard.admit("a", 33 * MIB)
    assert a1.admitted and guard.admit("a", 30 * MIB).admitted
    over = guard.admit("a", 2 * MIB)
    assert over.verdict == "throttle" and "buffered" in over.reason
    # Hub-wide cap: b is refused for memory the others hold, without a violation against b.
    busy = guard.admit("b", 40 * MIB)
    assert busy.verdict == "throttle" and busy.reason == "hub busy"
    guard.release("a", a1)
    assert guard.admit("b", 40 * MIB).admitted
    assert guard.buffered_bytes == 70 * MIB
    with pytest.raises(ValueError):
        guard.release("b", busy)


def test_prune_forgets_idle_peers_only():
    clock = Clock()
    guard = PeerGuard(TrustConfig(), clock)
    guard.release("idle", guard.admit("idle", 0))
    held = guard.admit("busy", 0)
    clock.now += 120.0
    assert guard.prune(idle_s=60.0) == 1
    assert guard.last_active("idle") is None and guard.last_active("busy") is not None
    guard.release("busy", held)


def test_token_buckets_of_throwaway_keys_stay_bounded_and_keep_the_newest():
    """Keys that each spend once and refill slowly (a bucket of model-file bytes, say) never fill the table past
    max_keys, and the newest buckets are kept: a flood forgets its own oldest keys first."""
    from shared.buckets import TokenBuckets

    buckets = TokenBuckets(per_s=1e-6, burst=2, max_keys=100)
    for i in range(1000):
        assert buckets.take(f"k{i}", 0.0) == 0.0
        assert len(buckets._buckets) <= 100
    assert buckets.level("k999", 0.0) == 1.0 and buckets.level("k0", 0.0) == 2.0  # k0 forgotten: full again
