"""Capacity model, activation and the control loop against hand-computed values."""

from __future__ import annotations

import math
import random

import pytest

from hub.method.capacity import (
    Arrival,
    InfeasibleCapacity,
    NodeOffer,
    activate,
    broadcast_stall_s,
    control_decision,
    cost_per_step,
    default_kappa,
    ewma,
    first_step_idle_s,
    fresh_usable_fraction,
    held_release,
    in_time_rollouts_per_s,
    mu_min,
    pool_stall_s,
    predicted_bubble,
    predicted_idle_s,
    predicted_step_s,
    rule_staleness,
    saturation,
    turned_rollouts_per_s,
    usable_fraction,
    validate_kappa,
)


def test_mu_min():
    # 3 * 100 / (3 * 10 - 5) = 300 / 25
    assert mu_min(3, 100, 10.0, 5.0) == pytest.approx(12.0)
    # DESIGN defaults R = 128 * 16 with kappa = 1: 2048 / (20 - 5)
    assert mu_min(1, 2048, 20.0, 5.0) == pytest.approx(2048 / 15)


def test_the_fleet_is_sized_by_the_losses_more_nodes_do_not_make_worse():
    # 100 settled: 60 trained, 30 dropped as stale, 10 with equal rewards. The stale 30 were usable groups made
    # too early or too slowly: counted as usable, the fleet makes 1 / 0.9 of R, not 1 / 0.6.
    assert fresh_usable_fraction(60, 100, 30) == pytest.approx(0.9)
    assert usable_fraction(60, 100) == pytest.approx(0.6)
    # Overproduction doubles the stale drops and leaves the other losses' share: the fraction does not move.
    assert fresh_usable_fraction(60, 160, 90) == pytest.approx(150 / 160)
    assert fresh_usable_fraction(0, 0, 0) == 1.0
    assert fresh_usable_fraction(0, 100, 0) == 0.05  # floored as usable_fraction is
    with pytest.raises(ValueError, match="stale <= settled - trained"):
        fresh_usable_fraction(60, 100, 41)


def test_a_saturated_reward_is_named_and_a_healthy_one_is_not():
    assert saturation(0.2, 0.8) is None  # at the bound: the fleet's to fix
    line = saturation(0.1, 0.9)
    assert line is not None and "same score in 90% of recent groups" in line and "activates none" in line
    assert "\n" not in line
    other = saturation(0.1, 0.3)
    assert other is not None and "discarded (banned or unaudited work)" in other


def test_the_papers_rule_charges_the_whole_broadcast_and_the_refined_only_its_overhang():
    # The paper's Qwen3-8B run: kappa = 2, R = 2048, T_train = 1631.2 s, T_bcast = 1437 s, S = 3.
    # paper:   2 * 2048 / (2 * 1631.2 - 1437)            = 4096 / 1825.4 = 2.244 rollouts/s
    # refined: the stall max(0, 1437 - (3 - 2) * 1631.2) = 0: 4096 / 3262.4 = 1.256 rollouts/s
    paper = mu_min(2, 2048, 1631.2, 1437.0, rule_staleness("paper", 3))
    refined = mu_min(2, 2048, 1631.2, 1437.0, rule_staleness("refined", 3))
    assert (round(paper, 3), round(refined, 3)) == (2.244, 1.256)
    # S = 0 keeps its meaning under both: no fleet keeps a synchronous learner busy.
    assert rule_staleness("paper", 0) == rule_staleness("refined", 0) == 0


def test_usable_fraction():
    assert usable_fraction(60, 100) == pytest.approx(0.6)  # 40 of 100 settled groups skipped
    assert usable_fraction(0, 0) == 1.0  # nothing settled yet: plan with R as is
    assert usable_fraction(0, 100) == 0.05  # floored: at most 20 x R
    with pytest.raises(ValueError):
        usable_fraction(5, 4)


@pytest.mark.parametrize("t_bcast_s", [20.0, 25.0])
def test_mu_min_infeasible(t_bcast_s):
    with pytest.raises(InfeasibleCapacity, match="raise the staleness budget S and kappa .* shrink the snapshot"):
        mu_min(2, 100, 10.0, t_bcast_s)
    assert issubclass(InfeasibleCapacity, ValueError)


def test_idle_and_bubble():
    # 300 / 10 + 5 - 30 = 5 s idle; bubble 5 / (5 + 30)
    assert predicted_idle_s(3, 100, 10.0, 5.0, 10.0) == pytest.approx(5.0)
    assert predicted_bubble(3, 100, 10.0, 5.0, 10.0) == pytest.approx(1 / 7)
    # exactly mu_min: no idle
    assert predicted_idle_s(3, 100, 10.0, 5.0, 12.0) == 0.0
    assert predicted_bubble(3, 100, 10.0, 5.0, 50.0) == 0.0
    assert predicted_idle_s(3, 100, 10.0, 5.0, 0.0) == math.inf
    assert predicted_bubble(3, 100, 10.0, 5.0, 0.0) == 1.0
    assert predicted_bubble(3, 100, 10.0, 5.0, -1.0) == 1.0


def test_s0_waits_for_the_broadcast_and_every_rollout():
    """S = 0: R = 100 rollouts at 10/s after a 5 s broadcast idle the learner 15 s per 20 s step, whatever the
    fleet (DESIGN's overlapped formula would say 0 s); no mu_min exists."""
    assert predicted_idle_s(1, 100, 20.0, 5.0, 10.0) == 0.0
    assert predicted_idle_s(1, 100, 20.0, 5.0, 10.0, staleness=0) == pytest.approx(15.0)
    assert predicted_bubble(1, 100, 20.0, 5.0, 10.0, staleness=0) == pytest.approx(15.0 / 35.0)
    assert predicted_idle_s(1, 100, 20.0, 5.0, 0.0, staleness=0) == math.inf
    with pytest.raises(InfeasibleCapacity, match="S = 0"):
        mu_min(1, 100, 20.0, 5.0, staleness=0)


def test_nodes_keep_generating_with_a_version_still_inside_the_window():
    """S = 5, kappa = 3, T_train = 10 s: version x serves through step x + 5, which ends S - kappa = 2 steps
    (20 s) after x + 3 is published, so a 15 s broadcast stalls nobody and a 35 s one stalls the fleet 15 s."""
    assert broadcast_stall_s(3, 10.0, 15.0) == 15.0  # DESIGN's formula: all of T_bcast
    assert broadcast_stall_s(3, 10.0, 15.0, staleness=5) == 0.0
    assert broadcast_stall_s(3, 10.0, 35.0, staleness=5) == pytest.approx(15.0)
    assert broadcast_stall_s(3, 10.0, 15.0, staleness=4) == pytest.approx(5.0)  # one step of slack
    assert broadcast_stall_s(1, 10.0, 35.0, staleness=0) == 45.0  # T_bcast + T_train
    # R = 90 per step at 10/s: 27 s of generation per 30 s period; a 15 s broadcast costs nothing with S = 5.
    assert predicted_idle_s(3, 90, 10.0, 15.0, 10.0, staleness=5) == 0.0
    assert predicted_idle_s(3, 90, 10.0, 15.0, 10.0) == pytest.approx(12.0)  # 27 + 15 - 30
    assert predicted_idle_s(3, 90, 10.0, 35.0, 10.0, staleness=5) == pytest.approx(12.0)  # 27 + 15 - 30
    assert mu_min(3, 90, 10.0, 15.0, staleness=5) == pytest.approx(9.0)  # 270 / 30
    assert mu_min(3, 90, 10.0, 15.0) == pytest.approx(18.0)  # 270 / (30 - 15)
    with pytest.raises(InfeasibleCapacity):
        mu_min(3, 90, 10.0, 50.0, staleness=5)  # stall 30 s: the version arrives already too old


def test_the_first_step_that_needs_the_newest_version_waits_for_its_rollouts():
    """S = 4, kappa = 3, T_train = 60 s: step V + 3 is the first to find V - 3 too stale; it starts 120 s
    after V is published. The pool (4 rollouts/s) holds V 100 s after the publish on average, so it has made
    80 of the 100 rollouts that step needs: 5 s idle, though the per-period balance says none."""
    arrival = Arrival(t_arrive_s=100.0, fresh_rollouts_per_step=100.0)
    assert first_step_idle_s(3, 60.0, 4.0, 4, arrival) == pytest.approx(5.0)  # 100/4 - (2 * 60 - 100)
    # Balance: 3 * 100 / 4 = 75 s of generation + a 46 s stall (106 - 60) < 180 s per period.
    assert predicted_idle_s(3, 100, 60.0, 106.0, 4.0, staleness=4) == 0.0
    assert predicted_idle_s(3, 100, 60.0, 106.0, 4.0, staleness=4, arrival=arrival) == pytest.approx(5.0)
    assert predicted_bubble(3, 100, 60.0, 106.0, 4.0, staleness=4, arrival=arrival) == pytest.approx(5.0 / 185.0)
    # Only R over the usable fraction *without* stale drops counts for that step: 60 rollouts take 15 s < 20 s.
    assert first_step_idle_s(3, 60.0, 4.0, 4, Arrival(100.0, 60.0)) == 0.0
    # Two active nodes with 32-rollout leases hand V's rollouts in half a lease behind a steady flow, so the
    # pool makes 60 + 32 before the step has 60 of V: 92 / 4 - 20 = 3 s.
    assert first_step_idle_s(3, 60.0, 4.0, 4, Arrival(100.0, 60.0, lease_rollouts=32.0)) == pytest.approx(3.0)
    # Where the balance is the tighter bound, it stays the prediction (27 + 15 - 30 = 12 > 9 - (30 - 30)).
    assert predicted_idle_s(3, 90, 10.0, 35.0, 10.0, staleness=5, arrival=Arrival(30.0, 90.0)) == pytest.approx(12.0)
    # DESIGN's formula (no S) has no first step to model; an empty pool never delivers.
    assert predicted_idle_s(3, 100, 60.0, 106.0, 4.0, arrival=arrival) == pytest.approx(75 + 106 - 180)
    assert first_step_idle_s(3, 60.0, 0.0, 4, arrival) == math.inf
    with pytest.raises(ValueError, match="kappa"):
        first_step_idle_s(3, 60.0, 4.0, 3, arrival)  # kappa > S - 1: the hub refuses such a run


def test_each_node_stalls_by_its_own_install_not_the_last_ones():
    """S = 5, kappa = 3, T_train = 10 s: a node may go on with the old version 20 s past the publish. Three
    nodes install at 5, 25 and 35 s (T_bcast 35 s): they stall 0, 5 and 15 s, weighted by their 1, 2 and 1
    rollouts/s: (0 + 10 + 15) / 4 = 6.25 s, where charging every node T_bcast's stall says 15 s."""
    installs = ((1.0, 5.0), (2.0, 25.0), (1.0, 35.0))
    assert pool_stall_s(3, 10.0, 5, installs) == pytest.approx(6.25)
    assert broadcast_stall_s(3, 10.0, 35.0, staleness=5) == pytest.approx(15.0)
    # The balance with it: 3 * 90 / 10 = 27 s of generation + 6.25 s - 30 s = 3.25 s idle (12 s with T_bcast's).
    arrival = Arrival(t_arrive_s=22.5, fresh_rollouts_per_step=30.0, installs=installs)
    assert predicted_idle_s(3, 90, 10.0, 35.0, 10.0, staleness=5, arrival=arrival) == pytest.approx(3.25)
    assert predicted_idle_s(3, 90, 10.0, 35.0, 10.0, staleness=5, arrival=Arrival(22.5, 30.0)) == pytest.approx(12.0)
    # One node is the fleet-wide formula; at S = 0 a node stalls through T_train as well.
    assert pool_stall_s(3, 10.0, 5, ((4.0, 35.0),)) == broadcast_stall_s(3, 10.0, 35.0, staleness=5)
    assert pool_stall_s(1, 10.0, 0, installs) == pytest.approx((5 + 50 + 35) / 4 + 10.0)
    for bad in ((), ((0.0, 5.0),), ((1.0, -1.0),), ((math.nan, 5.0),), ((1.0, math.inf),)):
        with pytest.raises(ValueError):
            pool_stall_s(3, 10.0, 5, bad)


def test_step_time_and_cost_per_step():
    # (30 + 5) / 3 s per step; (3 + 0.5 + 0.5) $/h * 35/3 s / 3600
    assert predicted_step_s(3, 100, 10.0, 5.0, 10.0) == pytest.approx(35 / 3)
    assert cost_per_step(3, 100, 10.0, 5.0, 10.0, 3.0, [0.5, 0.5]) == pytest.approx(4.0 * 35 / 3 / 3600)
    # no idle: step time is T_train
    assert cost_per_step(3, 100, 10.0, 5.0, 100.0, 3.6, []) == pytest.approx(0.01)


def test_node_offer_rho():
    assert NodeOffer("a", 0.35, 7.0).rho == pytest.approx(0.05)
    assert NodeOffer("z", 0.0, 0.0).rho == math.inf
    with pytest.raises(ValueError, match="price_per_hour"):
        NodeOffer("n", -1.0, 1.0)
    with pytest.raises(ValueError, match="rollouts_per_s"):
        NodeOffer("n", 1.0, -1.0)


FLEET = [
    NodeOffer("c", 0.3, 1.0),  # rho 0.3
    NodeOffer("z", 0.0, 0.0),  # free but delivers nothing: rho inf, last
    NodeOffer("b", 0.5, 5.0),  # rho 0.1, ties with a: after a by name
    NodeOffer("a", 1.0, 10.0),  # rho 0.1
]


def names(nodes):
    return [node.name for node in nodes]


def test_activate_shortest_cheapest_prefix_ties_by_name():
    for _ in range(3):
        fleet = random.Random(_).sample(FLEET, len(FLEET))
        result = activate(fleet, 12.0)
        assert names(result.active) == ["a", "b"]
        assert names(result.standby) == ["c", "z"]
        assert result.mu_active == 15.0 and result.shortfall == 0.0


def test_activate_exact_target_and_zero_target():
    assert names(activate(FLEET, 15.0).active) == ["a", "b"]
    assert names(activate(FLEET, 15.5).active) == ["a", "b", "c"]
    empty = activate(FLEET, 0.0)
    assert empty.active == () and len(empty.standby) == 4 and empty.mu_active == 0.0


def test_activate_fleet_falls_short():
    result = activate(FLEET, 16.5)
    assert names(result.active) == ["a", "b", "c", "z"]
    assert result.standby == ()
    assert result.mu_active == 16.0
    assert result.shortfall == pytest.approx(0.5)


def test_activate_rejects_duplicate_names():
    with pytest.raises(ValueError, match="duplicate node name 'a'"):
        activate([NodeOffer("a", 1, 1), NodeOffer("a", 2, 2)], 1.0)


def test_kappa_defaults_and_validation():
    assert [default_kappa(s) for s in (0, 1, 2, 4, 11)] == [1, 1, 1, 3, 10]
    for kappa, staleness in ((3, 4), (1, 4), (1, 2), (1, 1), (1, 0)):
        validate_kappa(kappa, staleness)
    for kappa, staleness in ((4, 4), (0, 4), (2, 2), (2, 1), (2, 0), (0, 0)):
        with pytest.raises(ValueError, match="kappa must satisfy"):
            validate_kappa(kappa, staleness)


def test_control_activates_cheapest_standby_below_target():
    active = [NodeOffer("a", 1.0, 5.0)]
    standby = [NodeOffer("y", 2.0, 10.0), NodeOffer("x", 1.0, 5.0), NodeOffer("w", 3.0, 1.0)]
    # x and y tie at rho 0.2: x by name
    decision = control_decision(active, standby, 10.0)
    assert (decision.action, decision.nodes) == ("activate", ("x",))
    assert control_decision(active, [], 10.0).action == "hold"


def test_control_release_needs_margin_inclusive_boundary():
    priciest = NodeOffer("b", 2.0, 5.0)  # rho 0.4
    # without b: 12 = 10 * (1 + 0.2): released
    decision = control_decision([NodeOffer("a", 1.0, 12.0), priciest], [], 10.0, release_margin=0.2)
    assert (decision.action, decision.nodes) == ("release", ("b",))
    # without b: 11.99 < 12: held, although the pool would still meet the bare target
    decision = control_decision([NodeOffer("a", 1.0, 11.99), priciest], [], 10.0, release_margin=0.2)
    assert (decision.action, decision.nodes) == ("hold", ())


def test_control_activates_as_many_cheapest_nodes_as_the_shortfall_needs():
    active = [NodeOffer("a", 1.0, 5.0)]
    # rho: x 0.1, y 0.2, z 0.2 (name after y), w 0.5; shortfall 20 - 5 = 15 needs x (8) and y (4) and z (4)
    standby = [NodeOffer("w", 5.0, 10.0), NodeOffer("z", 0.8, 4.0), NodeOffer("y", 0.8, 4.0), NodeOffer("x", 0.8, 8.0)]
    decision = control_decision(active, standby, 20.0)
    assert (decision.action, decision.nodes) == ("activate", ("x", "y", "z"))
    assert decision.reason == "pool 5/s below target 20/s"
    # the whole standby pool when even that falls short
    assert control_decision(active, standby, 100.0).nodes == ("x", "y", "z", "w")


def test_control_releases_the_priciest_nodes_the_margin_allows_in_one_move():
    # rho: a 0.1, b 0.2, c 0.3, d 0.4; target 10 with margin 12
    active = [NodeOffer("a", 1.0, 10.0), NodeOffer("b", 1.0, 5.0), NodeOffer("c", 1.5, 5.0), NodeOffer("d", 2.0, 5.0)]
    decision = control_decision(active, [], 10.0, release_margin=0.2)
    # without d: 20, without c too: 15 >= 12, without b too: 10 < 12: b stays
    assert (decision.action, decision.nodes) == ("release", ("d", "c"))
    assert decision.reason == "pool without these 2 15/s >= target with margin 12/s"


def test_control_replaces_the_priciest_node_with_as_many_cheaper_ones_as_it_takes():
    active = [NodeOffer("a", 1.0, 10.0), NodeOffer("p", 10.0, 10.0)]  # p: rho 1.0, needed (10 < 12 without it)
    standby = [NodeOffer("s1", 0.1, 1.0), NodeOffer("s2", 0.2, 1.5), NodeOffer("s3", 0.3, 2.0), NodeOffer("dear", 20.0, 9.0)]
    decision = control_decision(active, standby, 10.0, release_margin=0.2)
    # without p 10, and 12 - 10 = 2 more from the cheapest that beat p's rho: s1 (1) and s2 (1.5)
    assert (decision.action, decision.nodes) == ("activate", ("s1", "s2"))
    assert "cheaper nodes can replace it" in decision.reason


def test_control_replaces_several_pricey_nodes_in_one_move():
    # p1 and p2 (rho 1.0 and 0.9) are both needed (without p1: 10 < 12); c1 and c2 (rho 0.1) can replace both:
    # the cheapest pool that clears 12 is c1 + c2, so both come at once and later periods release p1, p2.
    active = [NodeOffer("p1", 10.0, 10.0), NodeOffer("p2", 9.0, 10.0)]
    standby = [NodeOffer("c1", 1.0, 10.0), NodeOffer("c2", 1.0, 10.0), NodeOffer("c3", 1.0, 10.0)]
    decision = control_decision(active, standby, 10.0, release_margin=0.2)
    assert (decision.action, decision.nodes) == ("activate", ("c1", "c2"))
    # once they work, p1 and p2 go in one release: 20 >= 12 without them
    decision = control_decision([*active, *standby[:2]], standby[2:], 10.0, release_margin=0.2)
    assert (decision.action, decision.nodes) == ("release", ("p1", "p2"))


def test_a_release_batch_is_released_only_as_far_as_every_period_of_the_hold_wanted_it():
    ready, wanted = held_release({}, ["c", "b", "a"], 0.0, 3.0)
    assert (ready, wanted) == ([], {"c": 0.0, "b": 0.0, "a": 0.0})
    ready, wanted = held_release(wanted, ["c", "b"], 1.0, 3.0)  # a noisy period wanted less: a starts over
    assert (ready, wanted) == ([], {"c": 0.0, "b": 0.0})
    ready, wanted = held_release(wanted, ["c", "b", "a"], 3.0, 3.0)
    assert (ready, wanted) == (["c", "b"], {"c": 0.0, "b": 0.0, "a": 3.0})  # a wanted for 0 s of 3
    given = {"c": 0.0}
    held_release(given, ["b"], 1.0, 3.0)
    assert given == {"c": 0.0}  # pure: the caller's map is left as it was


def test_release_leaves_the_pool_at_the_band_by_exact_sum():
    # 0.1 * 132 summed one by one drifts off 13.2; what stays must clear the band by math.fsum
    active = [NodeOffer(f"n{i:04d}", 0.01 * (1 + i % 7), 0.1) for i in range(1000)]
    decision = control_decision(active, [], 11.0, release_margin=0.2)
    kept = [n for n in active if n.name not in set(decision.nodes)]
    assert math.fsum(n.rollouts_per_s for n in kept) >= 11.0 * 1.2
    assert len(kept) in (132, 133)


def test_control_holds_exactly_at_target():
    assert control_decision([NodeOffer("a", 1.0, 10.0)], [NodeOffer("s", 0.1, 9.0)], 10.0).action == "hold"


def run_loop(release_margin: float, periods: int = 8) -> list[str]:
    """a's measured throughput wobbles +-5% around the target; b is the pricier helper."""
    a_mu = [10.5, 9.5] * (periods // 2)
    b = NodeOffer("b", 2.0, 3.0)
    active_b = True
    actions = []
    for mu in a_mu:
        a = NodeOffer("a", 1.0, mu)
        active, standby = ([a, b], []) if active_b else ([a], [b])
        decision = control_decision(active, standby, 10.0, release_margin=release_margin)
        actions.append(decision.action)
        if decision.action == "release":
            active_b = False
        elif decision.action == "activate":
            active_b = True
    return actions


def test_control_margin_prevents_flapping():
    assert run_loop(release_margin=0.0) == ["release", "activate"] * 4
    assert run_loop(release_margin=0.2) == ["hold"] * 8


def test_ewma():
    assert ewma(None, 5.0, 0.3) == 5.0
    assert ewma(10.0, 20.0, 0.25) == pytest.approx(12.5)
    assert ewma(10.0, 20.0, 1.0) == 20.0
    with pytest.raises(ValueError, match="alpha"):
        ewma(1.0, 2.0, 0.0)


def test_the_pace_a_late_lease_needed_is_its_rollouts_over_the_time_the_hub_allowed():
    # 32 rollouts held 40 s; the window's oldest moved 4 versions meanwhile, the work could take 1 of them (it was made
    # with the lease's minimum): the hub allowed 10 s, so 3.2 rollouts/s would have come back in time.
    assert in_time_rollouts_per_s(32, 40.0, 4, 1) == pytest.approx(3.2)
    # Made with a version two past the minimum: 3 of the 4 versions' time were its to use.
    assert in_time_rollouts_per_s(32, 40.0, 4, 3) == pytest.approx(32 / 30)
    assert in_time_rollouts_per_s(32, 0.0, 4, 1) is None and in_time_rollouts_per_s(32, 40.0, 0, 1) is None
    # Held for a nanosecond: capped where the reply's field is, so the reply is still sent.
    assert in_time_rollouts_per_s(10**6, 1e-9, 4, 1) == 1e9
    with pytest.raises(ValueError):
        in_time_rollouts_per_s(32, 40.0, 4, 0)


def test_a_tool_using_nodes_rate_is_what_its_turns_waits_leave():
    # 32 rollouts at 10/s take 3.2 s to generate, plus 3 rounds of 0.5 s waiting: 32 / 4.7
    assert turned_rollouts_per_s(10.0, 32, 3, 0.5) == pytest.approx(32 / 4.7)
    # however fast the node, 3 waits of 0.5 s per 32 rollouts bound it at 32 / 1.5
    assert turned_rollouts_per_s(1e12, 32, 3, 0.5) == pytest.approx(32 / 1.5)
    assert turned_rollouts_per_s(7.0, 32, 1, 0.0) == 7.0  # single-turn: unchanged
    for args, says in (
        ((0.0, 32, 1, 0.0), "rollouts_per_s"),
        ((1.0, 0, 1, 0.0), "batch"),
        ((1.0, 1, 0, 0.0), "turns"),
        ((1.0, 1, 1, -1.0), "wait"),
    ):
        with pytest.raises(ValueError, match=says):
            turned_rollouts_per_s(*args)
