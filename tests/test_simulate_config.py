"""bench/simulate.py as a tool: `--config sim.toml` (bench/sim_config.py), echo-hub plan's fleet file, a mid-run
fleet change, moving prices, `auto` rows through the hub's own staleness rule, and one-line mistakes."""

from __future__ import annotations

import json
import math
import random
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_bench_smoke import load_bench, printed_json

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "bench" / "presets"
SMALL = '[fleet]\nnodes = [20]\n[run]\nsteps = 24\nscenarios = ["cost-aware"]\n'


def write(tmp_path: Path, text: str, name: str = "sim.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_presets_load_and_the_default_is_the_documented_fleet() -> None:
    simulate = load_bench("simulate")
    sim_config = __import__("bench.sim_config", fromlist=["load_sim_config"])
    paper = sim_config.load_sim_config(PRESETS / "echo2-qwen3-8b.toml")
    assert paper.learner.rollouts_per_step == 128 * 16 and paper.run.staleness == (3,)
    halving = sim_config.load_sim_config(PRESETS / "halving.toml")
    assert "auto" in halving.run.staleness and halving.fleet_change[0].leave_share == 0.5
    assert [(g.share, g.rollouts_per_s, g.price_per_hour) for g in simulate.DEFAULT.fleet.gpu] == [
        (0.35, 6.0, 0.10),
        (0.35, 20.0, 0.35),
        (0.20, 35.0, 1.10),
        (0.10, 60.0, 2.50),
    ]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[run]\ngamma = 0.5\n", "run.gamma"),
        ("[fleet]\nnodez = [10]\n", "unknown key 'nodez' in [fleet]: did you mean 'nodes'?"),
        ("[[fleet.gpu]]\nshare = 0.5\nrollouts_per_s = 1\nprice_per_hour = 1\n", "sum to 1"),
        ("[run]\nstaleness = [2]\nkappa = 3\n", "kappa"),
        ("[[fleet_change]]\nat_s = 10\nleave_share = 1.5\n", "fleet_change.0.leave_share"),
        ("[links]\nmin_mbps = 500\nmax_mbps = 100\n", "min_mbps"),
        ("not toml = = 1", "not valid TOML"),
        ('[fleet]\nfile = "missing.toml"\n', "cannot read fleet file"),
        ("[run]\nstaleness = 3\n", "run.staleness takes a list: write staleness = [3], not staleness = 3"),
        ("[fleet]\nnodes = 10\n", "fleet.nodes takes a list: write nodes = [10], not nodes = 10"),
        ("[fleet]\ngpu = 3\n", "fleet.gpu takes tables: write [[fleet.gpu]] sections, not gpu = 3"),
        ("[run]\nstaleness = [65]\n", "less than or equal to 64"),  # the hub's own bound on S
        ("fleet = 3\n", "fleet: Input should be a valid dictionary"),
    ],
)
def test_a_bad_sim_toml_is_one_line_and_exit_2(tmp_path, capsys, text, says) -> None:
    simulate = load_bench("simulate")
    assert simulate.main(["--config", str(write(tmp_path, text)), "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err


def test_the_hubs_settings_default_and_bound_as_the_hub_does() -> None:
    """S, kappa, staleness_max, drift_max, gamma and the learner's price are read from the hub's config classes."""
    from bench.sim_config import SimConfig
    from hub.config import LearnerConfig, SchedulerConfig

    run, learner, hub = SimConfig().run, SimConfig().learner, LearnerConfig()
    assert (run.staleness, run.kappa, run.staleness_max, run.drift_max) == (
        (hub.staleness,),
        hub.kappa,
        hub.staleness_max,
        hub.drift_max,
    )
    assert (run.gamma, learner.price_per_hour) == (SchedulerConfig().gamma, hub.learner_price_per_hour)


def test_echo_hub_plans_fleet_file_is_the_fleet(tmp_path, capsys) -> None:
    simulate = load_bench("simulate")
    nodes = "".join(f'[[node]]\nname = "gpu{i}"\nprice_per_hour = {0.2 + 0.1 * i}\nrollouts_per_s = {5 + i}\n' for i in range(6))
    write(tmp_path, nodes, "fleet.toml")
    config = write(tmp_path, SMALL + "[learner]\nrollouts_per_step = 300\n")
    # fleet.file is relative to sim.toml; --fleet names it on the command line.
    assert simulate.main(["--config", str(config), "--fleet", str(tmp_path / "fleet.toml"), "--json"]) == 0
    (row,) = printed_json(capsys)["results"]
    assert row["nodes"] == 6 and row["rollouts_per_step"] == 300 and 0 < row["active_mean"] <= 6
    write(tmp_path, '[[node]]\nname = "x"\nprice_per_hour = -1\nrollouts_per_s = 1\n', "bad.toml")
    assert simulate.main(["--config", str(config), "--fleet", str(tmp_path / "bad.toml")]) == 2
    assert "node.0.price_per_hour: Input should be greater than or equal to 0" in capsys.readouterr().err


def test_a_tool_using_runs_waits_slow_each_node_as_echo_hub_plan_says(tmp_path, capsys) -> None:
    """[agents]: each node's rate is what its turns' waits leave (the capacity model's turned_rollouts_per_s, which
    echo-hub plan applies too); the same fleet then needs more of its nodes for the same R."""
    simulate = load_bench("simulate")
    nodes = "".join(f'[[node]]\nname = "gpu{i}"\nprice_per_hour = {0.2 + 0.1 * i}\nrollouts_per_s = {5 + i}\n' for i in range(6))
    write(tmp_path, nodes, "fleet.toml")
    agents = "[agents]\nturns = 3\nturn_wait_s = 2.0\n"
    cfg = __import__("bench.sim_config", fromlist=["load_sim_config"]).load_sim_config(write(tmp_path, SMALL + agents))
    fleet = simulate.fleet_from_file(tmp_path / "fleet.toml", random.Random(0), cfg)
    # 64 rollouts in step: 64 / (64 / mu + 3 * 2)
    assert [n.rate for n in fleet] == pytest.approx([64 / (64 / (5 + i) + 6) for i in range(6)])
    active = []
    for extra in ("", agents):
        config = write(tmp_path, SMALL + "[learner]\nrollouts_per_step = 300\n" + extra)
        assert simulate.main(["--config", str(config), "--fleet", str(tmp_path / "fleet.toml"), "--json"]) == 0
        (row,) = printed_json(capsys)["results"]
        active.append(row["active_mean"])
    assert active[1] > active[0]


def _sim(simulate, text: str, tmp_path: Path, scenario: str = "cost-aware", staleness=4):
    cfg = __import__("bench.sim_config", fromlist=["load_sim_config"]).load_sim_config(write(tmp_path, text))
    fleet = simulate.build_fleet(40, 0, None, cfg)
    sc = simulate.SCENARIOS[scenario]
    sim = simulate.Simulation(
        fleet, type(sc)(sc.name, staleness, sc.broadcast, sc.scheduler), 60, 0, simulate.demand(fleet, 4, 0.3, cfg), cfg
    )
    return sim


def test_half_the_fleet_leaves_at_once_and_stays_away(tmp_path) -> None:
    simulate = load_bench("simulate")
    sim = _sim(
        simulate,
        "[churn]\nsession_mean_s = 1e9\nonline_at_start = 1.0\n[[fleet_change]]\nat_s = 600\nleave_share = 0.5\n",
        tmp_path,
    )
    sim.run()
    gone = [n for n in sim.nodes.values() if n.away_until == math.inf]
    assert len(gone) == 20 and not any(n.online for n in gone)
    assert sim.online_count == 20 and sim.now > 600
    # Away for a while only: they come back when it ends.
    sim = _sim(
        simulate,
        "[churn]\nsession_mean_s = 1e9\nonline_at_start = 1.0\n[[fleet_change]]\nat_s = 600\nleave_share = 0.5\naway_s = 300\n",
        tmp_path,
    )
    sim.run()
    assert sim.online_count == 40 and sim.requests["join"] == 60


def test_moving_prices_are_paid_at_once_and_ranked_past_the_band(tmp_path) -> None:
    simulate = load_bench("simulate")
    sim = _sim(
        simulate,
        "[[price_change]]\nat_s = 0\nshare = 1.0\nfactor = 1.01\n[[price_change]]\nat_s = 1\nshare = 0.5\nfactor = 3.0\n",
        tmp_path,
    )
    before = {n.name: n.price for n in sim.nodes.values()}
    sim.run()
    tripled = [n for n in sim.nodes.values() if n.price == pytest.approx(before[n.name] * 3.03)]
    assert len(tripled) == 20
    for node in sim.nodes.values():
        # 1% is inside the hub's 5% band: ranked at the old price; x3 is not: ranked at the new one.
        ranked = node.price if node in tripled else before[node.name]
        assert node.offer.price_per_hour == pytest.approx(ranked)
    # The scheduler moved to the nodes that stayed cheap: most of the active pool is of the untouched half.
    active = [n for n in sim.nodes.values() if n.state == "active"]
    assert sum(n not in tripled for n in active) > len(active) / 2


def test_auto_rows_choose_s_through_the_hubs_rule(tmp_path, capsys) -> None:
    simulate = load_bench("simulate")
    config = write(tmp_path, SMALL.replace("steps = 24", 'steps = 40\nstaleness = ["auto", 2]\nstaleness_max = 6'))
    assert simulate.main(["--config", str(config), "--json"]) == 0
    out = printed_json(capsys)
    rows = {str(r["staleness"]): r for r in out["results"]}
    assert set(rows) == {"auto", "2"}
    auto = rows["auto"]
    assert 1 <= auto["staleness_final"] <= 6 and auto["staleness_moves"]
    assert all(1 <= s <= 6 for _, s, _ in auto["staleness_moves"])
    assert auto["staleness_max"] <= 6 and rows["2"]["staleness_max"] <= 2
    assert {r["staleness"] for r in out["savings"]} == {"auto", 2}
    # S = 2's steps train on rollouts at most 2 versions old: drift_per_version x 2 at the most, 0.01 x 2 < drift_max
    assert 0 < rows["2"]["drift_mean"] <= 0.02 and rows["2"]["drift_over_bound"] == 0
    [compared] = out["staleness_comparison"]
    assert compared["best_fixed"] == compared["best_fixed_eligible"] == 2
    json.dumps(out)  # every row is JSON as printed


def test_a_fixed_s_past_auto_s_drift_share_by_more_than_5_points_is_not_the_comparator() -> None:
    simulate = load_bench("simulate")
    row = lambda s, cost, over: {
        "nodes": 9,
        "scenario": "cost-aware",
        "seed": 0,
        "staleness": s,
        "cost_per_step": cost,
        "drift_over_bound": over,
        "capacity_rule": "refined",
    }
    results = [
        row("auto", 1.0, 0.0),
        row(2, 1.25, 0.0),
        row(4, 1.1, 0.05),
        row(8, 0.8, 0.4),
        {**row("auto", 2.0, 0.0), "seed": 1},
    ]
    # The same run under the other capacity rule is compared apart: a fixed S of one rule never prices the other's auto.
    paper = [{**r, "capacity_rule": "paper", "cost_per_step": 10 * r["cost_per_step"]} for r in results]
    *others, first, second = simulate.staleness_comparison(results + paper)
    assert [(c["capacity_rule"], c["seed"], c.get("best_fixed")) for c in others] == [("paper", 0, 8), ("paper", 1, None)]
    assert others[0]["saving_vs_best_fixed"] == -0.25 and first["capacity_rule"] == "refined"
    assert [r["eligible"] for r in first["fixed_rows"]] == [True, True, False]  # S = 4 at auto's 0 + 5 points
    assert first["best_fixed_eligible"] == 4 and first["saving_vs_best_fixed_eligible"] == round(1 - 1 / 1.1, 4)
    assert first["auto_within_eligible"] is True
    assert first["best_fixed"] == 8 and first["saving_vs_best_fixed"] == -0.25
    assert second["seed"] == 1 and "best_fixed" not in second  # a seed without fixed rows has nothing to compare


def test_the_drawn_fleet_is_unchanged_without_nat(tmp_path) -> None:
    """A config that sets nothing draws the same fleet as before the simulator took a config (same dice)."""
    simulate = load_bench("simulate")
    a = simulate.draw_fleet(25, random.Random(9))
    b = simulate.draw_fleet(25, random.Random(9), simulate.DEFAULT)
    assert [(n.rate, n.price, n.link_bps, n.reach) for n in a] == [(n.rate, n.price, n.link_bps, n.reach) for n in b]
    nated = _sim(simulate, "[fleet]\nnat_share = 1.0\nholepunch_s = 7\n", tmp_path)
    arrivals = dict((n.name, s) for n, s in simulate.broadcast_arrivals(list(nated.nodes.values()), "chain", nated.cfg))
    plain = dict((n.name, s) for n, s in simulate.broadcast_arrivals(list(nated.nodes.values()), "chain"))
    # Every hop after a chain's head is between two NATed nodes: each waits for one more hole punch.
    assert max(arrivals[k] - plain[k] for k in plain) == pytest.approx(
        7
        * (
            max(
                len(c)
                for c in simulate.plan_chains(
                    [(n.name, n.link_bps) for n in nated.nodes.values()],
                    nated.cfg.links.hub_uplink_mbps * simulate.BYTES_PER_MBIT,
                )
            )
            - 1
        )
    )


def test_an_over_provisioned_fleet_settles_at_the_need_and_does_not_climb(tmp_path) -> None:
    """Ten workers start all on (the hub activates every measured node until T_train is known): 2.5x the need.
    A broadcast nearly as long as a step leaves a take little room to queue. Leased up to the in-flight cap alone,
    the cap filled with work on the old version that a take then found stale (23% dropped), and sized by the
    fraction the hub trains on, those drops raised the target: 5 workers where 4 suffice. Leased only within fresh
    room (hub.records.buffer.fresh_room) almost nothing goes stale, and sized without stale drops
    (hub.method.capacity.fresh_usable_fraction) the fleet settles at the cheapest set that covers the target."""
    simulate = load_bench("simulate")
    from bench.sim_config import load_sim_config
    from hub.method.capacity import NodeOffer, activate, mu_min

    nodes = "".join(f'[[node]]\nname = "w{i}"\nprice_per_hour = 0.35\nrollouts_per_s = 0.44\n' for i in range(10))
    write(tmp_path, nodes, "fleet.toml")
    text = (
        '[fleet]\nfile = "fleet.toml"\nnat_share = 0.0\njitter_sigma = 0.0\n'
        "[links]\nhub_uplink_mbps = 800.0\nmedian_mbps = 185.0\nsigma = 0.0\nmin_mbps = 185.0\nmax_mbps = 185.0\n"
        "[churn]\nsession_mean_s = 1e9\nonline_at_start = 1.0\nprobe_s = 60.0\n"
        "[learner]\nt_train_s = 1631.2\nt_train_cv = 0.0\nrollouts_per_step = 2048\nusable_fraction = 1.0\n"
        "rollouts_per_lease = 16\n[snapshot]\nbytes = 32.8e9\n[run]\nstaleness = [3]\n"
    )
    cfg = load_sim_config(write(tmp_path, text))
    fleet = simulate.build_fleet(0, 0, None, cfg)
    sim = simulate.Simulation(fleet, replace(simulate.SCENARIOS["cost-aware"], staleness=3), 40, 0, 2048, cfg)
    sim.run()
    result = sim.result(len(fleet), 0)
    assert result.stale_dropped_fraction < 0.05
    # The need: the cheapest set reaching gamma * mu_min (S = 3, kappa = 2; the broadcast hides inside the window).
    target = 1.1 * mu_min(2, 2048, 1631.2, result.t_bcast_s, 3)
    need = len(activate([NodeOffer(f"w{i}", 0.35, 0.44) for i in range(10)], target).active)
    active_by_step = [record[3] for record in sim.records]
    assert active_by_step[0] == need and max(active_by_step) == need


def test_stale_rollouts_do_not_hold_the_in_flight_cap_while_the_learner_waits(tmp_path) -> None:
    """A lowered S leaves a whole version in the buffer that the next step cannot use. The learner drops it while it
    waits (as the hub's does, hub.records.buffer.ReplayBuffer.prune); kept, it filled the in-flight cap, no lease
    went out, and the run stalled for good (the halving preset's auto row, seed 1, stopped at step 21 of 400)."""
    simulate = load_bench("simulate")
    from bench.sim_config import load_sim_config

    text = (PRESETS / "halving.toml").read_text().replace('staleness = ["auto", 1, 2, 4, 8]', 'staleness = ["auto"]')
    cfg = load_sim_config(write(tmp_path, text.replace("steps = 400", "steps = 30")))
    fleet = simulate.build_fleet(200, 1, None, cfg)
    rollouts_per_step = simulate.demand(fleet, simulate.STALENESS, cfg.learner.demand_share, cfg)
    sim = simulate.Simulation(fleet, replace(simulate.SCENARIOS["cost-aware"], staleness="auto"), 30, 1, rollouts_per_step, cfg)
    sim.run()
    assert any(s < previous for (_, s, _), (_, previous, _) in zip(sim.staleness_moves[1:], sim.staleness_moves))
    assert sim.step == 30


def _sim_toml_keys() -> dict[str, list[str]]:
    """Every table of sim.toml and its keys, walked from SimConfig here (not through the help's generator)."""
    from typing import get_args

    from pydantic import BaseModel

    from bench.sim_config import SimConfig

    def arrays(model: type[BaseModel], prefix: str) -> dict[str, list[str]]:
        out = {}
        for name, field in model.model_fields.items():
            inner = [a for a in get_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
            if inner:
                out[f"[[{prefix}{name}]]"] = list(inner[0].model_fields)
        return out

    tables: dict[str, list[str]] = {}
    for name, field in SimConfig.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            section = field.annotation
            tables[f"[{name}]"] = [
                k for k, f in section.model_fields.items() if f"[[{name}.{k}]]" not in arrays(section, name + ".")
            ]
            tables |= arrays(section, name + ".")
    return tables | arrays(SimConfig, "")


def test_help_lists_every_sim_toml_section_and_key_with_its_flag(capsys) -> None:
    simulate = load_bench("simulate")
    with pytest.raises(SystemExit) as done:
        simulate.main(["--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    blocks = {block.split("\n", 1)[0].strip(): block for block in help_text.split("### ")[1:]}
    tables = _sim_toml_keys()
    assert {"[fleet]", "[[fleet.gpu]]", "[run]", "[[price_change]]", "[[fleet_change]]"} <= set(tables)
    for table, keys in tables.items():
        assert table in blocks, f"--help lists no {table}"
        for key in keys:
            assert f"| `{key}` |" in blocks[table], f"--help lists no {table} {key}"
    # Every flag that sets a key is listed beside it, and names a real key.
    assert "| `nodes` | `--nodes` |" in blocks["[fleet]"] and "| `steps` | `--steps` |" in blocks["[run]"]
    config_flags = {
        flag for action in simulate.build_parser()._actions for flag in action.option_strings if flag.startswith("--")
    } - {"--help", "--config", "--set", "--json", "--plot"}
    assert config_flags == {flag for flags in simulate.FLAG_FIELDS.values() for flag in flags}
    for dotted in simulate.FLAG_FIELDS:
        section, key = dotted.split(".")
        assert key in tables[f"[{section}]"]


# The paper's ablation: T_bcast 1437 s with peer broadcast, 1830 s without; its broadcast figure: ~500 s chained
# and ~3000 s for the 800 Mbit/s star at N = 9.
@pytest.mark.parametrize(
    ("preset", "nodes", "chain_s", "star_s"),
    [("echo2-qwen3-8b.toml", 10, 1437.0, 1830.0), ("echo2-broadcast-figure.toml", 9, 500.0, 3000.0)],
)
def test_the_paper_presets_reproduce_its_broadcast_times(preset, nodes, chain_s, star_s) -> None:
    """Through the simulator's own broadcast model, on the fleet the preset draws: within 5% of the paper's."""
    simulate = load_bench("simulate")
    cfg = simulate.load_sim_config(PRESETS / preset)
    assert nodes in cfg.fleet.nodes
    fleet = simulate.build_fleet(nodes, 0, cfg.run.fleet_seed, cfg)
    for broadcast, paper in (("chain", chain_s), ("star", star_s)):
        seconds = max(s for _, s in simulate.broadcast_arrivals(fleet, broadcast, cfg))
        assert seconds == pytest.approx(paper, rel=0.05), (broadcast, seconds)


def test_the_ablation_presets_rows_carry_its_broadcast_times() -> None:
    """A short run of the preset's full and no-peer-broadcast rows: the T_bcast they report is the ablation's."""
    simulate = load_bench("simulate")
    cfg = simulate.load_sim_config(PRESETS / "echo2-qwen3-8b.toml")
    for scenario, paper in (("cost-aware", 1437.0), ("star", 1830.0)):
        row = simulate.simulate(10, scenario, 0, 4, fleet_seed=cfg.run.fleet_seed, cfg=cfg)
        assert row.t_bcast_s == pytest.approx(paper, rel=0.05)


@pytest.mark.parametrize("preset", ["echo2-qwen3-8b.toml", "echo2-broadcast-figure.toml"])
def test_every_value_of_a_paper_preset_says_where_it_comes_from(preset) -> None:
    """Each key's comment block (the comments and keys since the last blank line) carries a tag with its source:
    [paper: quote], [derived: formula] or [assumption: why]; no bare [paper] tag is left."""
    lines = (PRESETS / preset).read_text().splitlines()
    assert not any(tag in line for line in lines for tag in ("[paper]", "[derived]", "[assumption]"))
    block: list[str] = []
    for line in lines:
        text = line.strip()
        if not text:
            block = []
        if not text or text.startswith("["):
            continue
        block.append(text)
        if not text.startswith("#"):
            key = text.split("=")[0].strip()
            assert any(tag in " ".join(block) for tag in ("[paper: ", "[derived: ", "[assumption: ")), f"{key} has no tag"


def test_the_readmes_simulate_command_prints_the_readmes_table() -> None:
    """The command and the table as README.md shows them: the command, run as written, prints every line of it."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The paper's run, simulated", 1)[1].split("\n## ", 1)[0]
    command = next(part for part in section.split("`") if part.startswith("python bench/simulate.py"))
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert len(table) >= 5 and "full ECHO-2" in table[2]
    argv = shlex.split(command)
    ran = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-2000:]
    printed = ran.stdout.splitlines()
    assert [line for line in table if line not in printed] == []
    assert "warning" not in ran.stdout + ran.stderr  # the preset's own fleet is the one its links were fitted to


def test_set_changes_a_key_of_the_file_and_the_flags_still_override_it(capsys) -> None:
    """--set learner.price_per_hour prices the preset's learner (12.24 $/h) at 6.12 and 3.06: the learner's share of
    a step's cost falls with it, the same steps and workers (a learner's price ranks no worker), so 12.24 -> 6.12
    saves twice what 6.12 -> 3.06 does; --set run.steps gives way to --steps; a bad setting is one line and exit 2."""
    simulate = load_bench("simulate")
    short = ["--config", str(PRESETS / "echo2-qwen3-8b.toml"), "--seeds", "1", "--scenarios", "cost-aware", "--json"]
    short += ["--capacity-rule", "refined", "--set", "run.steps=100", "--steps", "8"]
    rows = []
    for settings in ([], ["--set", "learner.price_per_hour=6.12"], ["--set", "learner.price_per_hour=3.06"]):
        assert simulate.main([*short, *settings]) == 0
        rows += printed_json(capsys)["results"]
    assert [r["steps"] for r in rows] == [8, 8, 8] and len({r["active_mean"] for r in rows}) == 1
    full, half, quarter = (r["cost_per_step"] for r in rows)
    assert full > half > quarter and full - half == pytest.approx(2 * (half - quarter), rel=1e-3)
    assert simulate.main([*short, "--set", "learner.price_per_hou=6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "did you mean 'price_per_hour'?" in err and "\n" not in err


def test_a_fleet_outside_the_links_fit_is_flagged_and_the_fitted_one_is_not(capsys) -> None:
    """The paper preset's links are fitted at N = 10: N = 20's star (3,660 s: 20 x 32.8e9 B over 1433.9 Mbit/s) is
    flagged in the JSON and by one warning line, N = 10 is not; in the tables the warning follows them."""
    simulate = load_bench("simulate")
    args = ["--config", str(PRESETS / "echo2-qwen3-8b.toml"), "--seeds", "1", "--steps", "4"]
    args += ["--scenarios", "cost-aware,star", "--capacity-rule", "refined", "--nodes", "10,20"]
    assert simulate.main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    (flagged,) = out["links_outside_fit"]
    assert flagged["nodes"] == 20 and flagged["fitted_nodes"] == [10, 10]
    assert flagged["t_bcast_s"] == pytest.approx(20 * 32.8e9 / (1433.9e6 / 8), rel=0.01)
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "N = 20 " in warnings[0] and "3,66" in warnings[0]
    assert simulate.main(args) == 0
    tables = capsys.readouterr().out
    assert tables.rstrip().splitlines()[-1] == warnings[0] and "N = 10, S = 3" in tables and "N = 20, S = 3" in tables
    rows = out["ablation"]
    assert simulate.links_outside_fit(rows, None) == [] and simulate.links_outside_fit(rows, (10, 20)) == []
    assert [r["nodes"] for r in simulate.links_outside_fit(rows, (15, 30))] == [10]
