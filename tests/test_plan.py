"""`echo-hub plan` on real FLEET.toml files: hand-computed plans and every bad-fleet error."""

from __future__ import annotations

import argparse
import json

import pytest

from hub.cli.plan import PlanConfig, PlanError, add_plan_arguments, compute_plan, load_fleet, run_plan
from hub.method.capacity import NodeOffer

FLEET_ACE = """
[[node]]
name = "a"
price_per_hour = 0.5
rollouts_per_s = 5

[[node]]
name = "b"
price_per_hour = 0.4
rollouts_per_s = 2

[[node]]
name = "c"
price_per_hour = 1.0
rollouts_per_s = 10.0
"""

# R = 100, T_train = 10 s, T_bcast = 5 s, S = 4 -> kappa = 3: nodes keep generating with their version for
# S - kappa = 1 step (10 s) past the next publish, so the 5 s broadcast stalls nothing:
# mu_min = 300 / 30 = 10, mu_target = 1.1 * 10 = 11
PERIOD = ["--rollouts-per-step", "100", "--t-train", "10", "--t-bcast", "5"]


def run(tmp_path, capsys, fleet_text: str, *extra: str):
    fleet = tmp_path / "FLEET.toml"
    fleet.write_text(fleet_text)
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    code = run_plan(parser.parse_args(["--fleet", str(fleet), *extra]))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_met_by_cheapest_prefix(tmp_path, capsys):
    code, out, err = run(tmp_path, capsys, FLEET_ACE, *PERIOD, "--json")
    assert code == 0 and err == ""
    plan = json.loads(out)
    assert set(plan) == {
        "capacity_rule",
        "mu_min",
        "mu_target",
        "active",
        "mu_active",
        "shortfall",
        "predicted_bubble",
        "cost_per_hour",
        "cost_per_step",
        "node_rollouts_per_s",
        "round_trip_bound",
    }
    assert plan["node_rollouts_per_s"] == {"a": 5.0, "c": 10.0} and plan["round_trip_bound"] is None  # single-turn
    # rho: a 0.1, c 0.1 (after a by name), b 0.2; a + c = 15 >= 11
    assert plan["active"] == ["a", "c"]
    assert plan["mu_min"] == pytest.approx(10.0)
    assert plan["mu_target"] == pytest.approx(11.0)
    assert plan["mu_active"] == pytest.approx(15.0)
    assert plan["shortfall"] == 0.0
    # idle = max(0, 300 / 15 + 0 - 30) = 0
    assert plan["predicted_bubble"] == 0.0
    # 3.06 + 0.5 + 1.0 $/h over a 10 s step
    assert plan["cost_per_hour"] == pytest.approx(4.56)
    assert plan["cost_per_step"] == pytest.approx(4.56 * 10 / 3600)


def test_a_tool_using_runs_round_trips_slow_every_node_and_bound_the_fastest(tmp_path, capsys):
    # 10 rollouts in step, 2 rounds of 1 s each: rate = 10 / (10 / mu + 2). a: 10 / 4 = 2.5, b: 10 / 7 = 1.4286,
    # c: 10 / 3 = 3.3333; rho: a 0.2, b 0.28, c 0.3; all three (7.26) fall 3.74 short of 11; no node beats 10 / 2 = 5.
    turned = ("--turns", "2", "--turn-wait", "1", "--lease-rollouts", "10")
    code, out, err = run(tmp_path, capsys, FLEET_ACE, *PERIOD, *turned, "--json")
    assert code == 0 and err == ""
    plan = json.loads(out)
    assert plan["active"] == ["a", "b", "c"]
    assert plan["node_rollouts_per_s"] == pytest.approx({"a": 2.5, "b": 10 / 7, "c": 10 / 3})
    assert plan["shortfall"] == pytest.approx(11 - (2.5 + 10 / 7 + 10 / 3))
    assert plan["round_trip_bound"] == pytest.approx(5.0)
    code, out, err = run(tmp_path, capsys, FLEET_ACE, *PERIOD, *turned)
    assert code == 0 and "a node's most, however fast (rollouts/s)" in out and "waits counted" in out


def test_the_papers_capacity_rule_charges_the_whole_broadcast(tmp_path, capsys):
    # paper: mu_min = 3 * 100 / (3 * 10 - 5) = 12, target 13.2; a + c = 15 still covers it, and the step is
    # idle max(0, 300 / 15 + 5 - 30) = 0
    code, out, _ = run(tmp_path, capsys, FLEET_ACE, *PERIOD, "--capacity-rule", "paper", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["capacity_rule"] == "paper" and plan["active"] == ["a", "c"]
    assert (plan["mu_min"], plan["mu_target"], plan["predicted_bubble"]) == pytest.approx((12.0, 13.2, 0.0))
    with pytest.raises(SystemExit):
        run(tmp_path, capsys, FLEET_ACE, *PERIOD, "--capacity-rule", "upstream")
    assert "invalid choice: 'upstream'" in capsys.readouterr().err


def test_plan_fleet_falls_short(tmp_path, capsys):
    fleet = FLEET_ACE[: FLEET_ACE.index('[[node]]\nname = "c"')]
    code, out, _ = run(tmp_path, capsys, fleet, *PERIOD, "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["active"] == ["a", "b"]
    assert plan["mu_active"] == pytest.approx(7.0)
    assert plan["shortfall"] == pytest.approx(4.0)
    # idle = 300 / 7 + 0 - 30 = 90 / 7; bubble = (90/7) / (90/7 + 30) = 90 / 300
    assert plan["predicted_bubble"] == pytest.approx(0.3)
    # step = (30 + 90/7) / 3 = 300 / 21 s at 3.06 + 0.9 $/h
    assert plan["cost_per_hour"] == pytest.approx(3.96)
    assert plan["cost_per_step"] == pytest.approx(3.96 * 300 / 21 / 3600)


def test_plan_kappa_override_and_learner_price(tmp_path, capsys):
    code, out, _ = run(tmp_path, capsys, FLEET_ACE, *PERIOD, "--kappa", "1", "--gamma", "1.0", "--learner-price", "0", "--json")
    assert code == 0
    plan = json.loads(out)
    # stall = max(0, 5 - (4 - 1) * 10) = 0, mu_min = 100 / 10 = 10: a + c = 15 covers it
    assert plan["mu_min"] == pytest.approx(10.0)
    assert plan["active"] == ["a", "c"]
    assert plan["shortfall"] == 0.0
    assert plan["cost_per_hour"] == pytest.approx(1.5)
    # S = 0: the learner waits for every broadcast and every rollout, so no mu_min exists
    code, out, err = run(tmp_path, capsys, FLEET_ACE, *PERIOD, "--staleness", "0", "--json")
    assert code == 2 and out == "" and "S = 0" in err


def test_plan_table_output(tmp_path, capsys):
    code, out, _ = run(tmp_path, capsys, FLEET_ACE, *PERIOD)
    assert code == 0
    assert "mu_min" in out and "cost per learner step" in out
    assert out.index(" a ") < out.index(" c ")
    assert " b " not in out


def test_plan_infeasible_capacity(tmp_path, capsys):
    # stall = 45 - (4 - 3) * 10 = 35 s >= kappa * T_train = 30 s: the snapshot arrives too old to use
    code, out, err = run(tmp_path, capsys, FLEET_ACE, "--t-train", "10", "--t-bcast", "45", "--json")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and "shrink the snapshot" in err


def test_plan_bad_kappa(tmp_path, capsys):
    code, _, err = run(tmp_path, capsys, FLEET_ACE, *PERIOD, "--kappa", "4")
    assert code == 2 and "kappa must satisfy 1 <= kappa <= 3" in err


def node(name="n", price="1.0", throughput="2.0", extra=""):
    return f'[[node]]\nname = "{name}"\nprice_per_hour = {price}\nrollouts_per_s = {throughput}\n{extra}\n'


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        (node(price="-0.1"), "node.0.price_per_hour: Input should be greater than or equal to 0 (got -0.1)"),
        (node(throughput="0"), "node.0.rollouts_per_s: Input should be greater than 0"),
        (node(throughput="-3"), "node.0.rollouts_per_s: Input should be greater than 0 (got -3)"),
        (node() + node(), "node: duplicate node name 'n'"),
        ('[[node]]\nname = "n"\nprice_per_hour = 1.0\n', "node.0.rollouts_per_s is required"),
        (node(extra='gpu = "5090"'), "unknown key 'gpu' in [node.0]"),
        ("", "node is required: the candidate nodes, as [[node]] tables"),
        ('title = "x"\n' + node(), "unknown key 'title' in the top level"),
        (node(price='"cheap"'), "node.0.price_per_hour: Input should be a valid number (got 'cheap')"),
        (node(throughput="true"), "node.0.rollouts_per_s: Input should be a valid number (got True)"),
        (node(price="inf"), "node.0.price_per_hour: Input should be a finite number"),
        ('[[node]\nname = "n"', "is not valid TOML"),
        ("node = 3\n", "node takes tables: write [[node]] sections, not node = 3"),
    ],
)
def test_bad_fleets(tmp_path, capsys, fleet, message):
    code, out, err = run(tmp_path, capsys, fleet, *PERIOD)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err
    with pytest.raises(PlanError):
        load_fleet(tmp_path / "FLEET.toml")


def test_missing_fleet_file(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    code = run_plan(parser.parse_args(["--fleet", str(tmp_path / "nope.toml"), *PERIOD]))
    assert code == 2 and "cannot read fleet file" in capsys.readouterr().err


def test_compute_plan_directly():
    fleet = [NodeOffer("x", 0.35, 4.0), NodeOffer("y", 0.35, 2.0)]
    # S 3, kappa 2: stall = 6 - (3 - 2) * 4 = 2 s, mu_min = 2 * 12 / (2 * 4 - 2) = 4, target 4.4: x (rho 0.0875) then y
    plan = PlanConfig(rollouts_per_step=12, t_train=4.0, t_bcast=6.0, staleness=3, kappa=2, gamma=1.1, learner_price=3.06)
    result = compute_plan(fleet, plan)
    assert [n.name for n in result.active] == ["x", "y"]
    assert result.mu_min == pytest.approx(4.0)
    # idle = max(0, 24 / 6 + 2 - 8) = 0: step time is T_train
    assert result.predicted_step_s == pytest.approx(4.0)
    assert result.cost_per_step == pytest.approx((3.06 + 0.7) * 4.0 / 3600)


def test_the_plans_bounds_and_defaults_are_the_hubs(tmp_path, capsys):
    """gamma, S, kappa and the learner's price are the hub's own settings: its bounds refuse, its defaults fill in."""
    from hub.config import LearnerConfig, SchedulerConfig

    plan = PlanConfig(t_train=1.0, t_bcast=0.0)
    assert (plan.gamma, plan.staleness, plan.learner_price) == (
        SchedulerConfig().gamma,
        LearnerConfig().staleness,
        LearnerConfig().learner_price_per_hour,
    )
    for flag, value, says in (
        ("--gamma", "0.9", "gamma: Input should be greater than or equal to 1"),
        ("--staleness", "65", "staleness: Input should be less than or equal to 64"),
        ("--learner-price", "-1", "learner_price: Input should be greater than or equal to 0"),
        ("--rollouts-per-step", "0", "rollouts_per_step: Input should be greater than 0"),
    ):
        code, out, err = run(tmp_path, capsys, FLEET_ACE, *PERIOD, flag, value)
        assert code == 2 and out == "" and err.startswith("error: echo-hub plan: ") and says in err, err
        assert len(err.strip().splitlines()) == 1
