"""bench/sensitivity.py: the paper's run over the unknowns it leaves (learner size, per-worker rate) is the simulator's
own run of the preset with those two values changed, and a cell near the paper's $/step is marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_bench_smoke import load_bench, printed_json

PRESET = Path(__file__).resolve().parent.parent / "bench" / "presets" / "echo2-qwen3-8b.toml"
SHORT = ["--set", "run.seeds=1", "--set", "run.steps=4"]


def test_a_cell_changes_the_learners_price_and_scales_every_worker_class_alike() -> None:
    sensitivity = load_bench("sensitivity")
    base = sensitivity.load_sim_config(PRESET)
    cfg = sensitivity.cell_config(base, 2, 0.22, 3.06, "paper")
    assert cfg.learner.price_per_hour == pytest.approx(6.12)
    assert [g.rollouts_per_s for g in cfg.fleet.gpu] == pytest.approx([0.22, 0.125, 0.30])
    assert [g.price_per_hour for g in cfg.fleet.gpu] == [g.price_per_hour for g in base.fleet.gpu]
    assert cfg.run.scenarios == ("cost-aware", "star", "all-on") and cfg.run.capacity_rule == ("paper",)


def test_the_presets_own_cell_is_the_simulators_run_of_the_preset(capsys) -> None:
    """At 4 A100s and 0.44 rollouts/s (the preset's own values) each rule's cell costs what bench/simulate.py prints
    for the preset under that rule, variant by variant, and a wide tolerance marks it as matching."""
    sensitivity = load_bench("sensitivity")
    simulate = load_bench("simulate")
    assert simulate.main(["--config", str(PRESET), *"--steps 4 --seeds 1 --scenarios cost-aware,star,all-on --json".split()]) == 0
    rows = {(r["capacity_rule"], r["scenario"]): r for r in printed_json(capsys)["results"]}
    assert sensitivity.main(["--learners", "4", "--rates", "0.44", "--tolerance", "0.5", *SHORT, "--json"]) == 0
    out = printed_json(capsys)
    assert {c["capacity_rule"] for c in out["grid"]} == {"paper", "refined"} == {rule for rule, _ in rows}
    for cell in out["grid"]:
        rule = cell["capacity_rule"]
        full = rows[(rule, "cost-aware")]["cost_per_step"]
        assert cell["cost_per_step"] == pytest.approx(full)
        assert cell["no_peer_broadcast"]["cost_per_step"] == pytest.approx(rows[(rule, "star")]["cost_per_step"])
        assert cell["no_cost_aware"]["delta_vs_full"] == pytest.approx(
            rows[(rule, "all-on")]["cost_per_step"] / full - 1, abs=1e-4
        )
        assert cell["off_paper"] == pytest.approx(cell["cost_per_step"] / 8.098 - 1, abs=1e-4)
    assert out["matches"] == [c for c in out["grid"] if abs(c["off_paper"]) <= 0.5]
    json.dumps(out)


def test_the_markdown_marks_the_matching_cells_only(capsys) -> None:
    sensitivity = load_bench("sensitivity")
    args = ["--learners", "4,8", "--rates", "0.44", *SHORT, "--set", 'run.capacity_rule=["refined"]', "--markdown"]
    assert sensitivity.main([*args, "--tolerance", "0"]) == 0
    text = capsys.readouterr().out
    assert "**" not in text.split("\n\n")[1] and "(none within the tolerance)" in text
    assert sensitivity.main([*args, "--tolerance", "10"]) == 0
    text = capsys.readouterr().out
    assert text.split("\n\n")[1].count("**") == 4  # both cells bold
    matched = [line for line in text.splitlines() if line.startswith(("| refined | 4 | 0.44 |", "| refined | 8 | 0.44 |"))]
    assert len(matched) == 2


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("run.seedz=1", "unknown key 'seedz' in [run]: did you mean 'seeds'?"),
        ("run.seeds=x", "is not a TOML value"),
        ("run.seeds", "write KEY=VALUE"),
        ("run.seeds=0", "run.seeds"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2(capsys, setting, says) -> None:
    sensitivity = load_bench("sensitivity")
    assert sensitivity.main(["--learners", "4", "--rates", "0.44", "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
