"""Every fault scenario of testbed/fault_scenarios.py (also measured by bench/faults.py), one test per class,
in its quick size against real processes on loopback: each cheat is detected and neither trained on
nor paid, honest work alongside is never refused, a SIGKILLed hub loses and double-counts nothing,
and the run survives losing 30% of its nodes. A scenario that fails is a row of its own naming why, and
the next one still runs.

The protocol cheats share one hub and the caught-later cheats another (module fixtures); every
test brings its own fresh identities."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest

from testbed.fault_scenarios import (
    AUDIT_CHEATS,
    BENCH_ONLY,
    PROTOCOL_CHEATS,
    HubProc,
    ScenarioResult,
    run_cheat,
    run_churn,
    run_crash,
    run_row,
    start_audit_hub,
    start_protocol_hub,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def protocol_hub(tmp_path_factory) -> HubProc:
    hub = start_protocol_hub(tmp_path_factory.mktemp("faults-protocol"))
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def audit_hub(tmp_path_factory) -> HubProc:
    hub = start_audit_hub(tmp_path_factory.mktemp("faults-audit"))
    yield hub
    hub.stop()


def assert_cheat_failed(r: ScenarioResult) -> None:
    assert r.attempts > 0, r
    assert r.detected == r.attempts, r
    assert r.accepted == 0, r
    assert r.false_rejections == 0, r
    assert r.shown_cost_matches_ledger, r
    assert r.paid <= 0.0, r


@pytest.mark.parametrize("name", [n for n in PROTOCOL_CHEATS if n not in BENCH_ONLY])
def test_protocol_cheat_is_refused_and_unpaid(name: str, protocol_hub: HubProc) -> None:
    assert_cheat_failed(run_cheat(name, protocol_hub, quick=True))


@pytest.mark.parametrize("name", AUDIT_CHEATS)
def test_caught_later_cheat_is_banned_and_its_pay_voided(name: str, audit_hub: HubProc) -> None:
    assert_cheat_failed(run_cheat(name, audit_hub, quick=True))


def test_sigkilled_hub_loses_and_pays_nothing_twice(tmp_path: Path) -> None:
    crash = run_crash(tmp_path, kills=2, say=lambda _: None)
    assert crash["kills"] >= 2 and crash["integrity_ok"] and crash["versions_monotone"], crash
    assert (crash["lost"], crash["double_counted"], crash["paid_twice"]) == (0, 0, 0), crash


def test_run_survives_losing_30_percent_of_its_nodes(tmp_path: Path) -> None:
    churn = run_churn(tmp_path, nodes=4, say=lambda _: None)
    assert churn["run_completed"] and churn["survivors_with_snapshot"] == churn["survivors"], churn


def test_a_failing_scenario_is_a_row_of_its_own_and_the_next_still_runs(protocol_hub: HubProc, tmp_path: Path) -> None:
    stopped = start_protocol_hub(tmp_path)
    stopped.stop()
    # As bench/faults.py runs them: the first against a hub that is gone, the next against the running one.
    failed, ran = (run_row("replay", partial(run_cheat, "replay", hub, True)) for hub in (stopped, protocol_hub))
    assert failed.name == "replay" and "the hub is not running" in failed.error, failed
    assert failed.attempts == failed.detected == 0, failed
    assert ran.error is None, ran
    assert_cheat_failed(ran)
