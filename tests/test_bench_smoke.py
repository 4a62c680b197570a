"""Smoke runs of bench/learner.py and bench/staleness.py with tiny settings: they run and print the promised JSON.

The benches are scripts, not an installed package, so they are loaded from their files.
No speed is asserted; the checks are on the shape of the output and on facts that hold at
any size (TRL and echo2 compute the same first-step loss; staleness never exceeds S).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sqlite3
import sys
import types
from pathlib import Path
from types import ModuleType

import pytest

# The benches' own checks: CI runs them as a step of their own (`-m bench`), after the suite.
pytestmark = pytest.mark.bench

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: dataclasses look their module up in sys.modules.
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def printed_json(capsys) -> dict:
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    return json.loads(lines[-1])


def printed_json_block(capsys) -> dict:
    """What a bench printing indented JSON (its last output) printed."""
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


@pytest.mark.slow
def test_learner_bench_smoke(default_model_dir, capsys):
    pytest.importorskip("trl")
    result = load_bench("learner").main(["--json", "--prompts", "2", "--n", "4", "--completion-len", "4", "--repeats", "2"])
    assert printed_json(capsys) == result
    assert {"device", "shape", "params", "tokens", "echo2_mfu", "trl_mfu", "first_step"} <= result.keys()
    assert result["echo2_step_s"] > 0 and result["trl_step_s"] > 0
    assert result["ratio"] == pytest.approx(result["echo2_step_s"] / result["trl_step_s"], rel=0.01)
    assert len(result["echo2_step_s_all"]) == len(result["trl_step_s_all"]) == 2
    # Each side's process measured its own peak RSS growth during a step.
    assert result["echo2_peak_bytes"] > 0 and result["trl_peak_bytes"] > 0
    first = result["first_step"]
    assert first["echo2_grad_norm"] > 0  # the batch carries signal, so the comparison below means something
    # Same weights, batch and objective: the two losses and gradient norms agree to float rounding.
    assert first["echo2_loss"] == pytest.approx(first["trl_loss"], rel=1e-3, abs=1e-6)
    assert first["echo2_grad_norm"] == pytest.approx(first["trl_grad_norm"], rel=1e-3)


def test_the_learners_step_on_a_multi_turn_batch_is_trls_with_its_tool_mask(default_model_dir, capsys):
    """A tool's answer in every completion: echo2 trains on the model's tokens only (env_spans), TRL under its
    tool_mask; the same first loss and gradient (TRL without its mask: 0.85 apart in loss)."""
    pytest.importorskip("trl")
    argv = ["--json", "--prompts", "2", "--n", "4", "--completion-len", "8", "--tool-tokens", "5", "--repeats", "1"]
    result = load_bench("learner").main(argv)
    first = result["first_step"]
    assert result["tool_tokens"] == 5 and first["echo2_grad_norm"] > 0
    assert first["echo2_loss"] == pytest.approx(first["trl_loss"], rel=1e-3, abs=1e-6)
    assert first["echo2_grad_norm"] == pytest.approx(first["trl_grad_norm"], rel=1e-3)


GPU_CALL_LIMIT_S = 600  # one command on a lent GPU machine (its run tool's per-call limit)
GPU_INSTALL_S = 40  # bench/gpu_learner.sh's own start: the carried wheels' install and nvidia-smi


def test_gpu_learner_script_runs_only_flags_the_bench_takes_and_each_mode_fits_one_gpu_call():
    """A lent GPU gives a session one 15-minute go: a misspelt flag in bench/gpu_learner.sh, or a mode whose
    timeouts add up past one call, would spend it on an argparse error or a killed run, found only there."""
    import shlex

    learner = load_bench("learner")
    seconds: dict[str, int] = {}
    mode = None
    for line in (BENCH_DIR / "gpu_learner.sh").read_text().replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] in (["if"], ["elif"]) and "=" in words:  # the mode's test: [ "$1" = MODE ]
            mode = words[words.index("=") + 1]
        elif words == ["else"] and mode is not None:
            mode = "scale"
        elif words == ["fi"]:
            mode = None
        elif words[:1] == ["bench"] and mode is not None:
            _name, limit, *args = words[1:]
            learner.parse_args(["--device", "cuda", "--json", *args])  # argparse's exit 2 on a flag it does not take
            seconds[mode] = seconds.get(mode, 0) + int(limit)
        elif words[:1] == ["timeout"] and mode is not None:
            seconds[mode] = seconds.get(mode, 0) + int(words[1])
    assert set(seconds) == {"figures", "compile", "scale"}  # the modes the script's header names
    assert all(total + GPU_INSTALL_S <= GPU_CALL_LIMIT_S for total in seconds.values()), seconds


def test_the_learner_bench_refuses_flex_attention_off_cuda_in_one_line(capsys):
    with pytest.raises(SystemExit) as refused:
        load_bench("learner").main(["--attention", "flex_attention"])
    assert refused.value.code == 2
    assert "--attention flex_attention trains on CUDA only" in capsys.readouterr().err


def test_e2e_against_trl_smoke(default_model_dir, tmp_path, capsys):
    """Two steps of TRL's GRPOTrainer, then two of `echo-hub start` with one node, on the embedded default: the
    promised JSON, both sides trained (a row per step, completions generated, a policy evaluated per step) on the
    recipe of echo2's own defaults. The S = 0 run is the same command with --staleness 0: left out for time."""
    pytest.importorskip("trl")
    from hub.config import HubConfig

    plot = tmp_path / "e2e.png"
    args = [
        "--steps",
        "2",
        "--nodes",
        "1",
        "--eval-every",
        "1",
        "--eval-prompts",
        "8",
        "--eval-samples",
        "1",
        "--trl-threads",
        "1",
    ]
    out = load_bench("e2e").main(["--against", "trl", "--json", "--no-s0", *args, "--plot", str(plot)])
    assert printed_json(capsys) == json.loads(json.dumps(out))
    assert plot.stat().st_size > 0
    assert out["recipe"] == load_bench("trl_grpo").recipe(HubConfig()) and out["setup"] == "default"
    assert {"target_heldout", "time_to_trl_final_ratio", "heldout_gap"} <= out.keys() and "echo2_s0" not in out
    assert out["target_heldout"] == pytest.approx(out["trl"]["heldout_final"] - out["tolerance"])
    for name in ("trl", "echo2"):
        side = out[name]
        assert [row["step"] for row in side["steps"]] == [1, 2] and side["steps_done"] == 2
        assert [point["step"] for point in side["heldout"]] == [0, 1, 2]
        assert all(0.0 <= point["accuracy"] <= 1.0 for point in side["heldout"])
        assert side["heldout_final"] == side["heldout"][-1]["accuracy"]
        assert 0 < side["first_step_s"] <= side["train_s"] <= side["wall_s"]
        assert side["generated_tokens"] > 0 and side["generated_tokens_per_s"] > 0
    # The starting model is evaluated once, for both: the same prompts, sampler and seed.
    assert out["trl"]["heldout"][0] == out["echo2"]["heldout"][0]


def test_trl_gets_echo2s_recipe_under_its_own_names(tmp_path):
    """A recipe unlike the defaults reaches GRPOConfig whole: each value under TRL's name, the batch as prompts x
    group size; and its flags are echo-hub start's, which read back the same recipe."""
    trl = pytest.importorskip("trl")
    from hub.config import HubConfig, LearnerConfig
    from shared.rollout import SamplingParams

    grpo = load_bench("trl_grpo")
    learner = LearnerConfig(
        lr=1e-5,
        lr_scheduler="cosine",
        warmup_ratio=0.1,
        weight_decay=0.01,
        grad_clip=0.5,
        group_size=4,
        prompts_per_step=3,
        eps_low=0.1,
        eps_high=0.3,
        beta=0.04,
        loss_type="grpo",
        seed=7,
        advantage_scale="batch",
    )
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_new_tokens=32)
    config = HubConfig(learner=learner, sampling=sampling)
    args = trl.GRPOConfig(**grpo.grpo_settings(config), output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert (args.learning_rate, args.lr_scheduler_type, args.get_warmup_steps(100), args.weight_decay) == (
        1e-5,
        "cosine",
        10,
        0.01,
    )
    assert (args.max_grad_norm, args.num_generations, args.per_device_train_batch_size) == (0.5, 4, 12)
    assert (args.epsilon, args.epsilon_high, args.beta, args.loss_type, args.scale_rewards) == (0.1, 0.3, 0.04, "grpo", "batch")
    assert (args.temperature, args.top_p, args.top_k, args.min_p, args.max_completion_length) == (0.7, 0.9, 20, 0.05, 32)
    assert (args.seed, args.num_iterations, args.gradient_checkpointing) == (7, 1, False)
    assert grpo.recipe(grpo.hub_config(grpo.recipe_flags(config))) == grpo.recipe(config)


def test_e2e_times_each_side_to_trls_final_heldout_accuracy():
    e2e = load_bench("e2e")
    point = lambda step, t_s, accuracy: {"step": step, "t_s": t_s, "accuracy": accuracy, "reward": accuracy}
    out = {
        "trl": {"heldout": [point(0, 0.0, 0.2), point(10, 50.0, 0.5), point(20, 100.0, 0.6)], "heldout_final": 0.6},
        "echo2": {"heldout": [point(0, 0.0, 0.2), point(10, 20.0, 0.58), point(20, 40.0, 0.7)], "heldout_final": 0.7},
        "echo2_s0": {"heldout": [point(0, 0.0, 0.2), point(10, 30.0, 0.4), point(20, 60.0, 0.5)], "heldout_final": 0.5},
    }
    result = e2e.comparison(out, 0.03)
    # The target is TRL's final 0.6 less 0.03: TRL reached it at its end (100 s), echo2 at step 10 (20 s), S = 0 never.
    assert result["target_heldout"] == 0.57
    assert (out["trl"]["time_to_trl_final_s"], out["echo2"]["step_to_trl_final"]) == (100.0, 10)
    assert out["echo2_s0"]["time_to_trl_final_s"] is None
    assert result["time_to_trl_final_ratio"] == 0.2 and result["time_to_trl_final_ratio_s0"] is None
    assert result["heldout_gap"] == 0.1 and result["heldout_gap_s0"] == -0.1


def test_the_user_setups_reward_scores_trls_conversational_completions(tmp_path):
    """bench/e2e.py --setup user: the reward function as TRL and the hub call it, and the files it trains on."""
    from shared.tasks.split import is_held_out

    setup = load_bench("user_setup")
    prompts = [[{"role": "user", "content": "abc"}]] * 2
    completions = [[{"role": "assistant", "content": "cba"}], [{"role": "assistant", "content": "abc"}]]
    assert setup.reversed_word(prompts, completions, answer=["cba", "cba"], trainer_state=None) == [1.0, 0.0]
    flags, dataset, reward = setup.build(tmp_path, 0.05)
    rows = {
        name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()] for name in ("train.jsonl", "test.jsonl")
    }
    assert (
        dataset == tmp_path / "train.jsonl" and reward in flags and flags[flags.index("--eval-task") + 1].endswith("test.jsonl")
    )
    # The reverse task's words, its held-out split apart: no word on both sides.
    words = {name: {row["prompt"][0]["content"] for row in part} for name, part in rows.items()}
    assert len(words["train.jsonl"]) + len(words["test.jsonl"]) == 4096 and not words["train.jsonl"] & words["test.jsonl"]
    assert all(is_held_out(w + ">", 0.05) for w in words["test.jsonl"])
    assert all(row["answer"] == row["prompt"][0]["content"][::-1] for part in rows.values() for row in part)
    assert "chat_template" in json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())


def test_staleness_bench_smoke(default_model_dir, tmp_path, capsys):
    out = tmp_path / "staleness.png"
    result = load_bench("staleness").main(
        [
            "--json",
            "--steps",
            "3",
            "--staleness",
            "0",
            "--no-is-ratio",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-prompts",
            "8",
            "--window",
            "1",
            "--out",
            str(out),
        ]
    )
    assert printed_json(capsys) == json.loads(json.dumps(result))
    assert out.stat().st_size > 0
    assert [(r["staleness"], r["is_ratio"]) for r in result["runs"]] == [(0, True), (2, False)]
    for run in result["runs"]:
        assert {
            "staleness",
            "is_ratio",
            "reward_first",
            "reward_last",
            "reward_at_step",
            "staleness_mean",
            "wall_s",
        } <= run.keys()
        assert run["steps"] == 3
        assert 0.0 <= run["staleness_mean"] <= run["staleness_max"] <= run["staleness"]
        assert run["reward_at_step"] and all(0.0 <= r <= 1.0 for r in run["reward_at_step"].values())
        assert run["reward_first"] == run["reward_at_step"][min(run["reward_at_step"])]
        assert run["reward_last"] == run["reward_at_step"][max(run["reward_at_step"])]


def test_reward_curve_windows():
    curve = load_bench("staleness").reward_curve
    samples = [(0, 0.0), (1, 1.0), (2, 0.5), (5, 1.0), (6, 0.0)]
    # Versions 0..2 fill the first window; 5 and 6 (the final policy, clamped to the last window) the second.
    assert curve(samples, 6, 3) == {3: 0.5, 6: 0.5}
    # kappa > window: windows without a sampled version are left out, not reported as 0.
    assert curve([(0, 0.25), (10, 0.75)], 20, 4) == {4: 0.25, 12: 0.75}


def test_the_adaptive_comparison_marks_the_fixed_s_that_keep_auto_s_drift_bound_and_s0_s_reward():
    compare = load_bench("staleness").adaptive_comparison
    row = lambda scenario, s, reward, cost, over: {
        "scenario": scenario,
        "staleness": s,
        "reward_last": reward,
        "cost_per_step": cost,
        "drift_over_bound": over,
    }
    rows = [
        row("steady", 0, 0.30, 9.0, 0.0),
        row("steady", "auto", 0.27, 9.0, 0.1),
        row("half_leave", 1, 0.2, 2.0, 0.0),
        row("half_leave", 1, 0.2, 1.0, 0.2),
        row("half_leave", 1, 0.2, 1.2, 0.0),
        row("half_leave", 8, 0.1, 0.5, 0.9),
        row("half_leave", "auto", 0.2, 1.1, 0.1),
    ]
    out = compare(rows)
    assert out["steady"] == {"reward_s0": 0.30, "reward_auto": 0.27, "reward_gap": 0.03}
    half = out["half_leave"]
    # medians over the repeats: S = 1 costs 1.2 and passed the bound on 0 of its steps; S = 8 on 90% (auto: 10%)
    assert half["fixed_rows"] == [
        {"staleness": 1, "cost_per_step": 1.2, "drift_over_bound": 0.0, "reward_last": 0.2, "eligible": False},
        {"staleness": 8, "cost_per_step": 0.5, "drift_over_bound": 0.9, "reward_last": 0.1, "eligible": False},
    ]
    # S = 1's reward, 0.2, ended 0.1 below S = 0's 0.30: past the 0.05 allowed, so nothing is eligible
    assert "best_fixed_eligible" not in half and "auto_within_eligible" not in half
    assert half["best_fixed"] == 8 and half["saving_vs_best_fixed"] == round(1 - 1.1 / 0.5, 4)
    # S = 4: reward 0.26 (0.04 below S = 0's) and 15% of steps past the bound (auto's 10% + 5 points): eligible
    kept = compare([*rows, row("half_leave", 4, 0.26, 1.5, 0.15)])["half_leave"]
    assert kept["best_fixed_eligible"] == 4 and kept["saving_vs_best_fixed_eligible"] == round(1 - 1.1 / 1.5, 4)
    assert kept["auto_within_eligible"] is True
    dearer = compare([*rows, row("half_leave", 4, 0.26, 1.07, 0.15)])["half_leave"]
    assert dearer["auto_within_eligible"] is False  # 1.1 > 1.02 x 1.07
    assert compare([*rows, row("half_leave", 4, 0.26, 1.5, 0.16)])["half_leave"]["fixed_rows"][1]["eligible"] is False


def test_fleet_simulator_runs_the_projects_own_scheduler(monkeypatch, capsys):
    """Small fleets, few steps: every scenario runs, prints the promised fields, keeps staleness within S, and
    shows what holds at any size: the synchronous baseline idles the learner far more than the method, and
    the model's bubble follows the simulated one where a fleet can keep up."""
    simulate = load_bench("simulate")
    monkeypatch.setattr(sys, "argv", ["simulate.py", "--nodes", "30", "--steps", "24", "--json"])
    assert simulate.main() == 0
    out = printed_json(capsys)
    rows = {r["scenario"]: r for r in out["results"]}
    assert set(rows) == {"cost-aware", "all-on", "star", "sync"}
    for row in rows.values():
        assert {
            "nodes",
            "feasible",
            "bubble_simulated",
            "bubble_predicted",
            "cost_per_step",
            "t_bcast_s",
            "requests_per_s",
            "staleness_p95",
        } <= set(row)
        assert row["staleness_max"] <= (0 if row["scenario"] == "sync" else simulate.STALENESS)
    assert rows["sync"]["bubble_simulated"] > rows["cost-aware"]["bubble_simulated"] + 0.2
    assert abs(rows["cost-aware"]["bubble_simulated"] - rows["cost-aware"]["bubble_predicted"]) <= 0.05
    assert out["savings"][0]["saving_vs_all-on"] > 0


def test_scale_bench_measures_the_transport_floor_with_two_real_processes(tmp_path):
    """16 MiB over one bare stream between two processes: both ends' CPU is counted and the bytes arrive."""
    scale = load_bench("scale")
    floor = scale.measure_transport_floor(tmp_path, 16 << 20, lambda _: None)
    assert floor["transport_floor_cpu_s_per_gb"] > 0 and floor["transport_floor_mb_per_s"] > 0
    assert not (tmp_path / "floor").exists()


def test_scale_bench_relays_on_the_bulk_channel_and_on_libp2p_with_real_processes(default_model_dir, tmp_path):
    """The default model's snapshot through source -> relay -> sink twice: the bulk run took the bulk channel at
    both hops and the libp2p run took neither (measure_relay raises otherwise)."""
    scale = load_bench("scale")
    relay = scale.measure_relay(tmp_path, default_model_dir, "float32", None, lambda _: None)
    assert relay["relay_bytes"] > 0 and relay["relay_cpu_s_per_gb"] > 0 and relay["relay_libp2p_cpu_s_per_gb"] > 0
    assert not (tmp_path / "relay").exists()


def test_capacity_bench_bubble_error_comes_from_batches_of_whole_broadcast_periods():
    capacity = load_bench("capacity")
    # Batches of 2: bubbles 1/2 (idle 1, train 1 twice) and 0 (train only): mean bubble 2/6.
    rows = [{"t_idle_s": 1.0, "t_train_s": 1.0}] * 2 + [{"t_idle_s": 0.0, "t_train_s": 1.0}] * 2
    bubble, se = capacity.bubble_and_se(rows, batch=2)
    assert bubble == pytest.approx(1 / 3)
    # stdev of (0.5, 0) is sqrt(0.125); over sqrt(2) batches: 0.25.
    assert se == pytest.approx(0.25)
    # A pattern that repeats within each batch has no error; one batch has no estimate.
    assert capacity.bubble_and_se(rows[1:3] * 3, batch=2)[1] == 0.0
    assert capacity.bubble_and_se(rows[:3], batch=2)[1] == math.inf


def test_fleet_simulator_predicts_the_idle_of_the_first_step_after_a_slow_broadcast():
    """1,000 nodes: the broadcast (~97 s) leaves the step that needs the newest version short of rollouts.
    The per-period balance alone predicted no bubble there; with that step modelled the prediction
    follows the simulated idle."""
    simulate = load_bench("simulate")
    result = simulate.simulate(1000, "cost-aware", 0, 60)
    assert result.bubble_simulated > 0.01
    assert abs(result.bubble_simulated - result.bubble_predicted) <= 0.01


def test_fleet_simulator_draws_the_documented_mix_and_sizes_demand_on_the_hubs_own_model():
    """Every fleet of one size has the GPU mix's shares (largest remainder, ties to the earlier class), and its
    demand R makes the hub's mu_min the asked share of its expected online throughput, at its chain broadcast
    time: every fleet faces the same choice, whatever its slowest link."""
    simulate = load_bench("simulate")
    assert simulate.class_counts(10) == [4, 3, 2, 1]  # 3.5 and 3.5: the tie goes to the 3060 class
    assert simulate.class_counts(1000) == [350, 350, 200, 100]
    assert simulate.class_counts(7) == [3, 2, 1, 1]  # 2.45, 2.45, 1.4, 0.7: remainders .45 .45 .4 .7
    fleet = simulate.draw_fleet(40, simulate.random.Random(3))
    rates = sorted(round(n.rate) for n in fleet)
    assert len(fleet) == 40 and rates[0] < 10 and rates[-1] > 40
    # One node at 10 rollouts/s: 0.3 * 0.8 * 10 = 2.4/s is mu_min = 3 * (R / 0.7) / (3 * 60 s - stall).
    # A 1.2 GB snapshot at 24 MB/s takes 50 s: no stall (S - kappa = 1 step of 60 s covers it), R = 2.4 * 0.7 * 60.
    fast = simulate.Node("fast", 10.0, 1.0, 24e6)
    assert simulate.demand([fast], simulate.STALENESS, 0.3) == pytest.approx(100.8)
    # At 10 MB/s it takes 120 s: a 60 s stall, a 120 s window, R = 2.4 * 0.7 * 40.
    slow = simulate.Node("slow", 10.0, 1.0, 10e6)
    assert simulate.demand([slow], simulate.STALENESS, 0.3) == pytest.approx(67.2)
    assert [simulate.default_steps(n) for n in (10, 1000, 10000)] == [20000, 200, 90]


def test_fleet_simulator_scenarios_of_one_seed_face_the_same_churn_and_learner():
    """Common random numbers: cost-aware and all-on of one seed see each node come and go at the same times
    and the same T_train per step, so their difference in cost is the method's, not the dice's."""
    simulate = load_bench("simulate")
    fleet = simulate.draw_fleet(30, simulate.random.Random(7))
    schedules, ends = [], []
    for scenario in ("cost-aware", "all-on"):
        rollouts_per_step = simulate.demand(fleet, simulate.STALENESS, 0.3)
        sim = simulate.Simulation(fleet, simulate.SCENARIOS[scenario], 60, 3, rollouts_per_step)
        pushed: list[tuple[str, str, float]] = []
        push = sim.push

        def recording(at, kind, payload=None, push=push, pushed=pushed):
            if kind in ("join", "leave"):
                pushed.append((kind, payload, round(at, 6)))
            elif kind == "step_done":
                pushed.append((kind, "", round(payload, 6)))
            return push(at, kind, payload)

        sim.push = recording
        sim.run()
        schedules.append(pushed)
        ends.append(sim.now)
    churn = [sorted(e for e in s if e[0] != "step_done" and e[2] < min(ends)) for s in schedules]
    steps = [[e[2] for e in s if e[0] == "step_done"] for s in schedules]
    assert churn[0] == churn[1] and len(churn[0]) > 10
    assert steps[0] == steps[1] and len(steps[0]) == 60


def test_delta_bench_smoke(capsys):
    """Two publishes of the default model at lr 1e-6 through three real keepers: bit-exact, deltas small."""
    out = load_bench("delta").main(["--json", "--models", "default", "--lrs", "1e-6", "--publishes", "2"])
    assert printed_json(capsys) == json.loads(json.dumps(out))
    (run,) = out["results"]
    assert {
        "model",
        "lr",
        "publishes",
        "full_bytes",
        "delta_bytes_mean",
        "delta_ratio",
        "weights_bit_exact",
        "t_bcast_full_s",
        "t_bcast_delta_s",
    } <= set(run)
    assert run["publishes"] == 2 and run["weights_bit_exact"] and run["deltas_applied_per_node"] == [2, 2, 2]
    assert run["delta_ratio"] < 0.10 and run["t_bcast_delta_s"] > 0 and run["t_bcast_full_s"] > 0


def test_distributed_bench_smoke(capsys):
    """Two steps on the default model with 1 and 2 gloo processes: the promised fields, the same weights."""
    # Imported as bench.distributed, not loaded from its file: the spawned ranks import their target by name.
    import bench.distributed

    out = bench.distributed.main(["--json", "--models", "default", "--steps", "2"])
    assert printed_json(capsys) == json.loads(json.dumps(out))
    rows = {r["procs"]: r for r in out["results"]}
    assert set(rows) == {1, 2} and all(
        {"model", "procs", "step_s", "max_abs_weight_diff_vs_1proc"} <= set(r) for r in rows.values()
    )
    assert rows[2]["max_abs_weight_diff_vs_1proc"] <= 1e-5


def test_status_bench_smoke(capsys):
    """The status board's costs, the old per-request path beside the served one, at a small fleet."""
    out = load_bench("status").main(["--json", "--identities", "40"])
    assert printed_json(capsys) == json.loads(json.dumps(out))
    (row,) = out["rows"]
    assert row["identities"] == 40 and row["nodes_listed"] == 20  # the live half: the gone half left 2 h ago
    assert row["per_request_ms_served"] > 0 and row["per_request_ms_rebuilt"] > 0 and row["frame_bytes"] > 0


def test_soak_bench_fits_the_rss_line_over_the_hubs_last_life_and_kills_in_the_first_half(tmp_path):
    soak = load_bench("soak")
    # An earlier life at another baseline and the last life's warm-up do not count: the slope is the last life's 1.
    rss = [(0, 0, 100.0), (0, 1, 101.0), *((1, step, 300.0 + (step if step >= 13 else 50)) for step in range(10, 20))]
    samples = [soak.Sample(float(step), life, step, 0, 0, 0, mb, 10) for life, step, mb in rss]
    assert soak.slope(soak.settled_rss(samples)) == 1.0
    assert soak.slope([(5, 1.0)]) is None
    # A sample's RSS is the least reading since the one before (resting), its peak the most.
    soak_run = soak.Soak(tmp_path, 1.0, 0, print)
    (tmp_path / "hub").mkdir()
    sqlite3.connect(tmp_path / "hub" / soak.HUB_STORE_FILE).executescript(
        "CREATE TABLE steps (step INTEGER); CREATE TABLE payloads (group_json TEXT);"
    )
    sample = soak_run.sample(types.SimpleNamespace(process=types.SimpleNamespace(pid=os.getpid())), 0.0, [1.0, 1e6])
    assert sample.rss_mb == 1.0 and sample.rss_peak_mb == 1e6
    assert soak.rss_readings(os.getpid(), 0.25) and all(r > 1 for r in soak.rss_readings(os.getpid(), 0.1))
    assert soak.plan(600.0, kills=2, churns=2) == [(100.0, "churn"), (100.0, "kill"), (200.0, "kill"), (300.0, "churn")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_soak_bench_smoke(tmp_path):
    """Half a minute of the soak and on to 40 steps (a busy machine made too few in half a minute to measure the store's
    growth): a real hub killed once, two real nodes, long completions; every key, nothing lost."""
    import subprocess

    done = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "soak.py"),
            "--minutes",
            "0.5",
            # Steps, not seconds, are what growth is measured over: on a busy machine half a minute gave too few.
            "--min-steps",
            "40",
            "--kills",
            "1",
            "--nodes",
            "2",
            "--skip-resume",
            "--json",
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert {
        "minutes",
        "steps",
        "completion_tokens_mean",
        "payload_bytes_per_step",
        "store_bytes_per_step",
        "store_file_bytes_per_step",
        "data_dir_bytes_per_step",
        "hub_rss_slope_mb_per_1k_steps",
        "hub_rss_peak_mb",
        "hub_fds_first",
        "hub_fds_last",
        "kills",
        "acknowledged_lost",
        "resume_s_large_store",
        "log_bytes_max",
    } <= result.keys()
    assert result["store_bytes_per_step"] > 0 and result["store_file_bytes_per_step"] is not None
    assert result["kills"] == 1 and result["acknowledged_lost"] == 0 and result["steps"] > 0
    assert result["completion_tokens_mean"] >= 256
    assert "hub SIGKILLed (1/1)" in done.stderr


def test_ingest_bench_derives_the_fleet_from_the_smaller_of_the_hub_process_and_the_check_workers():
    fleet = load_bench("ingest").fleet_supported(hub_ms=0.4, worker_ms=2.0, beat_ms=1.0, heartbeats_per_s=25.0)
    # A node hands in 0.25 completions/s; the hub process keeps 1 - 25 beats/s x 1 ms = 0.975 of its core.
    assert fleet["nodes_by_hub_process"] == 9750 and fleet["nodes_by_check_workers"] == 30000
    assert fleet["fleet_supported_16_cores"] == 9750 and fleet["limited_by"] == "hub process"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ingest_bench_smoke(default_model_dir):
    """Old path (checks in a thread) and one check process side by side, every stage costed."""
    import subprocess

    out = subprocess.run(
        [sys.executable, str(BENCH_DIR / "ingest.py"), "--task", "reverse", "--procs", "0,1", "--submissions", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=380,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    old, new = result["runs"]
    assert (old["procs"], new["procs"]) == (0, 1) and new["scaling"] == 1.0
    for run in (old, new):
        assert run["completions"] == 4 * 4 * 8 and run["completions_per_s"] > 0 and run["fleet_supported_16_cores"] > 0
        assert set(run["cpu_ms_per_completion"]) == {
            "protocol",
            "signature",
            "parse",
            "decode",
            "reward",
            "copies",
            "ipc",
            "commit",
        }
    assert old["cpu_ms_per_completion"]["ipc"] == 0 < new["cpu_ms_per_completion"]["ipc"]


def test_sampling_bench_smoke(default_model_dir, capsys):
    """bench/sampling.py on a few groups: the honest node is never condemned, invented text is caught at once, and
    honest collapsed groups are never called copies."""
    assert (
        load_bench("sampling").main(["--groups", "2", "--copies", "16", "--setups", "T=1.0", "--cheats", "random", "--json"]) == 0
    )
    printed = printed_json_block(capsys)
    (result,) = printed["sampling"]
    assert result["honest_peak_statistic_nats"] < result["threshold_nats"]
    assert result["cheats"]["random"]["caught_after_groups"] == 1
    assert result["cheats"]["random"]["caught_by"] == "sampling test"
    assert [c["called_copies"] for c in printed["copies"]] == [0, 0]
