"""Moving prices: the ranking band, the change rules, the scheduler re-ranking without flapping, and a real hub
taking a price change over libp2p (bounded, rate-limited, paid at the price in force at lease time, kept in the
node's price history)."""

from __future__ import annotations

import math
import time

import pytest
import trio
from rich.console import Console

from hub.cli.status import render
from hub.config import HubConfig, LearnerConfig, LeaseConfig, SchedulerConfig
from hub.control.policy import RELEASE_HOLD_PERIODS, CapacityView, decide, fleet_view
from hub.method.prices import price_change_refusal, price_lease, ranking_price
from hub.records.fleet import Fleet, NodeRecord
from hub.service.status import RunInfo, StatusBoard
from node.client import HubClient
from node.hub_link import HubLink
from node.price_schedule import parse_price_schedule, scheduled_price
from shared.crypto import Identity
from shared.messages import Heartbeat, JoinRequest, PriceReply, Reject, RejectCode
from shared.net import running_host
from shared.rollout import Completion, Group, SamplingParams
from testbed.inproc import PERMISSIVE_TRUST, inproc_hub
from tests.test_p2p_negative import clients, joined_and_active


def test_ranking_price_moves_only_past_the_band() -> None:
    assert ranking_price(0.30, 0.31, 0.05) == 0.30  # 1 cent is within 5% of 0.30 (1.5 cents)
    assert ranking_price(0.30, 0.29, 0.05) == 0.30
    assert ranking_price(0.30, 0.32, 0.05) == 0.32
    assert ranking_price(0.30, 0.28, 0.05) == 0.28
    assert ranking_price(0.30, 0.31, 0.0) == 0.31
    assert ranking_price(0.0, 0.01, 0.05) == 0.01  # a free node that starts charging is re-ranked at once
    with pytest.raises(ValueError):
        ranking_price(0.3, 0.3, -0.1)


def test_price_change_rules() -> None:
    assert price_change_refusal(0.5, 10.0, None, 0.0, 600.0) is None
    assert price_change_refusal(0.5, 10.0, 100.0, 700.0, 600.0) is None
    assert "next in 100s" in price_change_refusal(0.5, 10.0, 100.0, 600.0, 600.0)
    assert "ceiling" in price_change_refusal(10.5, 10.0, None, 0.0, 600.0)
    for bad in (math.nan, math.inf, -0.01):
        assert "finite" in price_change_refusal(bad, 10.0, None, 0.0, 600.0)


def _fleet() -> Fleet:
    fleet = Fleet()
    for name, price, state in (("a", 0.30, "active"), ("b", 0.305, "standby")):
        fleet.put(
            NodeRecord(
                peer_id=name,
                price_per_hour=price,
                link_bps=1e8,
                backend="hf",
                hardware="",
                listen_addrs=(),
                remote_ip=None,
                last_seen=0.0,
                state=state,
                rollouts_per_s=10.0,
                measured=True,
            )
        )
    return fleet


def _periods(fleet: Fleet, prices: list[float], band: float, config: SchedulerConfig) -> list[tuple[str, str]]:
    """A's declared price at each control period (re-ranked as HubState.reprice does), and every move made."""
    # One node of 10/s covers the target; with the release margin a second is needed only to replace the first.
    capacity = CapacityView(0.0, 8.0 / config.gamma, 8.0, None, "test")
    moves, wanted = [], {}
    a = fleet.get("a")
    for period, price in enumerate(prices):
        a.ranked_price_per_hour = ranking_price(a.rank_price, price, band)
        a.price_per_hour = price
        decision = decide(fleet_view(fleet), capacity, config, wanted, period * config.control_period_s)
        wanted = decision.release_wanted
        for move in decision.moves:
            fleet.get(move.node).state = move.state
            moves.append((move.node, move.state))
    return moves


def test_a_price_change_re_ranks_the_pool_without_flapping() -> None:
    config = SchedulerConfig()
    # A cent either way, each price held past the release hold: b (0.305) is cheaper half the time.
    flapping = ([0.30] * (RELEASE_HOLD_PERIODS + 2) + [0.31] * (RELEASE_HOLD_PERIODS + 2)) * 3
    assert _periods(_fleet(), flapping, config.price_band, config) == []
    # Without the band the same prices swap a for b and back, over and over.
    assert len(_periods(_fleet(), flapping, 0.0, config)) >= 4
    # A real move (a doubles its price) re-ranks at the next period: b is bought, then a released after the hold.
    fleet = _fleet()
    moves = _periods(fleet, [0.30, 0.60] + [0.60] * (RELEASE_HOLD_PERIODS + 1), config.price_band, config)
    assert moves == [("b", "active"), ("a", "standby")]
    assert fleet.get("a").state == "standby" and fleet.get("b").state == "active"


CONFIG = HubConfig(
    learner=LearnerConfig(staleness=2, prompts_per_step=8, group_size=2, buffer_max_groups=1000),
    sampling=SamplingParams(max_new_tokens=8),
    lease=LeaseConfig(prompts_per_lease=2, lease_timeout_s=60.0),
    scheduler=SchedulerConfig(price_change_interval_s=1.0),
    trust=PERMISSIVE_TRUST,
)


@pytest.mark.trio
async def test_a_joined_node_re_declares_its_price(tmp_path, default_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    with trio.fail_after(30):
        async with inproc_hub(tmp_path, default_model_dir, CONFIG) as hub, clients(hub, tokenizer, 2) as (node, stranger):
            assert (await stranger.reprice(0.4)).code == RejectCode.UNKNOWN_NODE  # only members may
            await joined_and_active(node)  # joined at $0.50/h
            held = await node.lease()
            reply = await node.reprice(0.7)
            assert isinstance(reply, PriceReply) and reply.price_per_hour == 0.7 and reply.next_change_in_s == 1.0
            record = hub.state.fleet.get(node.peer_id)
            assert (record.price_per_hour, record.rank_price) == (0.7, 0.7)
            # The lease held across the change keeps the price it was issued at; the next one gets the new price.
            assert hub.state.leasing.book.open[held.lease_id].price_per_hour == 0.5
            assert hub.state.leasing.book.open[(await node.lease()).lease_id].price_per_hour == 0.7
            # Too soon, and out of bounds: refused and counted against the node, the price unchanged.
            too_soon = await node.reprice(0.8)
            assert isinstance(too_soon, Reject) and too_soon.code == RejectCode.BAD_REQUEST and "next in" in too_soon.reason
            await trio.sleep(1.0)
            assert "ceiling" in (await node.reprice(CONFIG.scheduler.max_price_per_hour + 1)).reason
            assert record.price_per_hour == 0.7 and record.tallies.refused == 2
            assert isinstance(await node.reprice(0.71), PriceReply)  # within the band: paid, not re-ranked
            assert (record.price_per_hour, record.rank_price) == (0.71, 0.7)
            same = await node.reprice(0.71)  # the price in force again: no change, not refused, the wait unchanged
            assert isinstance(same, PriceReply) and 0 < same.next_change_in_s <= 1.0
            await hub.state.flush()
            history = hub.state.store.members.price_history(limit_per_node=10)[node.peer_id]
            assert [price for _, price in history] == [0.5, 0.7, 0.71]
            assert hub.state.store.members.node(node.peer_id).price_per_hour == 0.71
            # The status board and `echo-hub status` show how the price moved; a status without the key does not.
            board = StatusBoard(
                RunInfo(hub.identity.peer_id, (hub.addr,), 0, 2, 1, "t", "chain"), tmp_path, hub.state, learner_step=lambda: 0
            )
            status = board.snapshot()
            (shown,) = [n for n in status.nodes if n.peer_id == node.peer_id]
            assert [price for _, price in shown.price_history] == [0.5, 0.7, 0.71]
            assert status.redact().nodes[0].price_history == ()
            console = Console(record=True, width=200)
            render(status, console)
            text = console.export_text()
            assert "$/h 0.50 (" in text and "-> 0.70 (" in text and "-> 0.71 (" in text


def test_a_price_schedule_follows_the_clock_across_midnight() -> None:
    schedule = parse_price_schedule("23:00=0.30, 07:00=0.45,18:30=0.60")
    assert schedule == ((7 * 60, 0.45), (18 * 60 + 30, 0.60), (23 * 60, 0.30))
    assert scheduled_price(schedule, 0) == 0.30  # before the day's first entry: the day before's last
    assert scheduled_price(schedule, 7 * 60 - 1) == 0.30
    assert scheduled_price(schedule, 7 * 60) == 0.45
    assert scheduled_price(schedule, 18 * 60 + 29) == 0.45
    assert scheduled_price(schedule, 23 * 60 + 59) == 0.30
    assert scheduled_price(parse_price_schedule("12:00=1"), 5) == 1.0
    for bad in ("7am=0.3", "07:00=0.3,07:00=0.4", "24:00=1", "07:00=-1", "07:00=2000", ""):
        with pytest.raises(ValueError):
            parse_price_schedule(bad)


@pytest.mark.trio
async def test_a_node_link_re_declares_its_scheduled_price(tmp_path, default_model_dir) -> None:
    """The node side: HubLink joins at the schedule's price and re-declares it when the schedule moves, at most
    as often as the hub takes a change."""
    asked, identity = [0.40], Identity.generate()
    with trio.fail_after(30):
        async with (
            inproc_hub(tmp_path, default_model_dir, CONFIG) as hub,
            running_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as (host, _),
        ):
            node = HubClient(host, identity, hub.addr, timeout_s=10)

            def join_request() -> JoinRequest:
                return JoinRequest(
                    price_per_hour=asked[0],
                    hardware="test",
                    link_bps=1e8,
                    backend="hf",
                    dtype="float32",
                    model_config_hash=hub.config_hash,
                    version_held=-1,
                )

            link = HubLink(
                node,
                join_request,
                lambda: Heartbeat(version_held=-1),
                lambda reply: None,
                backoff_max_s=0.5,
                price=lambda: asked[0],
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.run)
                while hub.state.fleet.get(node.peer_id) is None:
                    await trio.sleep(0.05)
                record = hub.state.fleet.get(node.peer_id)
                assert record.price_per_hour == 0.40
                asked[0] = 0.55
                while record.price_per_hour != 0.55:
                    link.beat_now.set()
                    await trio.sleep(0.05)
                asked[0] = 0.65  # before the hub takes another change (1 s): the link waits rather than be refused
                await trio.sleep(0.5)
                assert record.price_per_hour == 0.55
                while record.price_per_hour != 0.65:
                    link.beat_now.set()
                    await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
            assert record.tallies.refused == 0
            assert [e.kind for e in link.state.events].count("price") == 2
            assert [price for _, price in record.price_history] == [0.40, 0.55, 0.65]


def test_a_nodes_price_history_is_bounded(tmp_path) -> None:
    """However often a node re-declares (or rejoins at a new price), the store keeps its newest
    PRICES_KEPT_PER_NODE prices, and the newest are the ones kept."""
    from hub.records.schema import PRICES_KEPT_PER_NODE
    from hub.records.store import Store

    store = Store(tmp_path / "hub.sqlite")
    store.members.upsert_node("peer-a", 0.1, "cpu", 1000, "hf", "standby")
    start = time.time() + 1  # after the join's own row
    for i in range(PRICES_KEPT_PER_NODE + 50):
        assert store.members.set_node_price("peer-a", 0.2 + i / 1000, at=start + i)
    history = store.members.price_history(10 * PRICES_KEPT_PER_NODE)["peer-a"]
    store.close()
    assert len(history) == PRICES_KEPT_PER_NODE
    assert history[0][0] == start + 50 and history[-1] == (
        start + PRICES_KEPT_PER_NODE + 49,
        pytest.approx(0.2 + (PRICES_KEPT_PER_NODE + 49) / 1000),
    )


def test_a_rejoin_keeps_the_price_change_clock() -> None:
    """Issue 54 item 5: a join reset price_changed_at, so leave, re-join and reprice took 20 changes in 0.3 s."""

    def join(price: float) -> JoinRequest:
        return JoinRequest(
            price_per_hour=price, hardware="h", link_bps=1e8, backend="hf", model_config_hash="ab", dtype="float32"
        )

    fleet = Fleet()
    record = fleet.join("p", join(1.0), None, now=0.0)
    assert record.price_changed_at is None  # a first join is no change
    record.price_changed_at = 10.0  # a reprice at t=10 s
    fleet.join("p", join(1.0), None, now=11.0)  # re-join at the same price: the clock stays
    assert record.price_changed_at == 10.0
    assert price_change_refusal(2.0, 100.0, record.price_changed_at, 12.0, 600.0) is not None
    fleet.join("p", join(3.0), None, now=20.0)  # re-join at another price: that is a change
    assert record.price_changed_at == 20.0
    assert price_change_refusal(4.0, 100.0, record.price_changed_at, 30.0, 600.0) is not None
    assert price_change_refusal(4.0, 100.0, record.price_changed_at, 621.0, 600.0) is None


def test_a_tool_using_lease_is_paid_for_the_tokens_its_node_sampled_not_the_tools_answers() -> None:
    terms = LeaseConfig(lease_timeout_s=600.0, paid_tokens_per_s_floor=10.0, max_cost_per_lease_usd=100.0)
    called = Completion(
        token_ids=tuple(range(10)), logprobs=(-0.1,) * 10, finish_reason="stop", version=0, text="", env_spans=((2, 6),)
    )
    alone = called.model_copy(update={"env_spans": ()})
    assert called.sampled_tokens() == 4 and alone.sampled_tokens() == 10
    group = Group(prompt_id="p", prompt_text="p", version=0, completions=(called, called), rewards=(1.0, 0.0))
    pay = price_lease(0.0, 3600.0, 1, [group], 100.0, terms)  # held 100 s; 8 sampled tokens at 10/s: 0.8 s billed
    assert pay.tokens == 8 and pay.billed_s == pytest.approx(0.8) and pay.usd == pytest.approx(0.8)
