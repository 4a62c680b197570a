"""The command lines speak TRL's language: TRL's names are flags and hub.toml keys, a typo in a flag or a key gets
"did you mean" in one line (exit 2), and --help shows an example and defaults as a person types them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared.flags import closest, unknown_flag_message
from tests.test_first_contact import ROOT, assert_one_line_mistake, run, snapshot_of


def test_the_closest_flag_is_named() -> None:
    known = ["--group-size", "--num-generations", "--lr", "--learning-rate", "--help"]
    assert closest("--num-generatons", known) == "--num-generations"
    assert closest("--group_size", known) == "--group-size"
    assert closest("--zzz", known) is None
    assert unknown_flag_message(["--learnin-rate=3", "x"], known) == "unknown flag --learnin-rate; did you mean --learning-rate?"
    assert unknown_flag_message(["stray"], known) == "unexpected argument 'stray'; see --help"


def test_another_word_is_not_offered_as_the_flag_meant() -> None:
    """TRL users' flags echo-hub does not have get "see --help", not a flag they did not mean."""
    import argparse

    from hub.cli.main import build_parser

    start = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["start"]
    known = [option for action in start._actions for option in action.option_strings]
    for wrong in ("--save-total-limit", "--dry-run", "--quiet"):
        assert unknown_flag_message([wrong], known) == f"unknown flag {wrong}; see --help", wrong
    assert unknown_flag_message(["--learnin-rate"], known) == "unknown flag --learnin-rate; did you mean --learning-rate?"


def test_typos_in_flags_and_toml_keys_get_did_you_mean(tmp_path: Path) -> None:
    before = snapshot_of(tmp_path)
    data = str(tmp_path / "data")
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--num-generatons", "8"),
        "echo-hub start:",
        "unknown flag --num-generatons",
        "did you mean --num-generations?",
    )
    assert_one_line_mistake(
        run("hub.cli", "eval", "--model", data, "--max-completion-lenght", "8"), "did you mean --max-completion-length?"
    )
    assert_one_line_mistake(run("hub.cli", "status", "--data_dir", data), "did you mean --data-dir?")
    assert_one_line_mistake(run("node.cli", "join", "--hubb", "x"), "echo-node join:", "did you mean --hub?")
    assert_one_line_mistake(run("hub.cli", "statsu"), "echo-hub: unknown command 'statsu'; did you mean status?")
    toml = tmp_path / "hub.toml"
    toml.write_text("learning_rat = 1e-5\n")
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--config", str(toml)),
        "unknown key 'learning_rat'",
        "did you mean 'learning_rate'?",
    )
    toml.write_text('[learner]\nlora_targets = "q_proj"\n')  # a scalar where a list goes
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--config", str(toml)),
        'learner.lora_targets takes a list: write lora_targets = ["q_proj"]',
    )
    toml.write_text("[learner]\nstalenes = 2\n")
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--config", str(toml)), "[learner]", "did you mean 'staleness'?"
    )
    toml.unlink()
    assert snapshot_of(tmp_path) == before


def test_trl_names_set_the_same_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each TRL name reaches its field: the field's own bounds refuse the value, naming the field. The names run
    through `echo-hub start`'s own main in this process (a refusal comes before any thread or file, and the command
    line's one line and exit 2 are checked with real interpreters below and in tests/test_first_contact.py)."""
    from hub.cli.main import main

    data = str(tmp_path / "data")
    for flag, value, field in (
        ("--num-generations", "1", "learner.group_size"),
        ("--learning-rate", "2", "learner.lr"),
        ("--max-completion-length", "0", "sampling.max_new_tokens"),
        ("--max-steps", "-1", "steps"),
        ("--epsilon", "-1", "learner.eps_low"),
        ("--epsilon-high", "-1", "learner.eps_high"),
        ("--max-grad-norm", "0", "learner.grad_clip"),
        ("--save-steps", "0", "learner.checkpoint_every"),
        ("--beta", "-1", "learner.beta"),
        ("--lr-scheduler-type", "polynomial", "learner.lr_scheduler"),
        ("--warmup-ratio", "2", "learner.warmup_ratio"),
        ("--log-completions", "-1", "tracking.log_completions"),
        ("--loss-type", "cispo", "learner.loss_type"),
        ("--top-k", "-1", "sampling.top_k"),
        ("--min-p", "1", "sampling.min_p"),
        ("--vllm-importance-sampling-mode", "sequence_clip", "learner.rollout_is_mode"),
        ("--vllm-importance-sampling-clip-max", "0.5", "learner.rollout_is_threshold"),
        ("--vllm-importance-sampling-cap", "0.5", "learner.rollout_is_threshold"),
        ("--vllm-importance-sampling-clip-min", "2", "learner.rollout_is_threshold_lower"),
        ("--importance-sampling-level", "geometric", "learner.importance_sampling_level"),
        ("--off-policy-mask-threshold", "0", "learner.off_policy_mask_threshold"),
    ):
        assert main(["start", "--data-dir", data, flag, value]) == 2
        printed = capsys.readouterr()
        assert printed.out == "" and printed.err.count("\n") == 1 and field in printed.err, (flag, printed)
    assert not Path(data).exists()
    toml = tmp_path / "hub.toml"
    toml.write_text("num_generations = 1\nmax_steps = 5\n")  # TRL's names as flat hub.toml keys
    line = assert_one_line_mistake(run("hub.cli", "start", "--data-dir", data, "--config", str(toml)), "learner.group_size")
    assert "max_steps" not in line  # an alias of a top-level field (steps) is taken, not refused as unknown
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", data, "--steps", "0", "--lr-scheduler", "cosine"),
        "--lr-scheduler cosine",
        "needs --steps N",
    )


def test_more_than_one_iteration_is_refused_saying_how_staleness_relates(tmp_path: Path) -> None:
    """TRL's num_iterations reuses each batch of rollouts: refused in one line that names S as the setting here."""
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", str(tmp_path / "data"), "--num-iterations", "3"),
        "learner.num_iterations: 3 (TRL's mu) would train each batch of rollouts 3 times",
        "up to 2 versions stale",
        "--staleness S >= 2",
    )
    assert snapshot_of(tmp_path) == before


def test_a_repetition_penalty_is_refused_saying_why_audits_could_not_check_it(tmp_path: Path) -> None:
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", str(tmp_path / "data"), "--repetition-penalty", "1.1"),
        "repetition_penalty: 1.1 would penalise tokens",
        "would fail honest nodes' audits",
    )
    assert snapshot_of(tmp_path) == before


def test_an_epsilon_the_loss_cannot_take_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """eps_low = 1 would clip ratios at 0: the config's bound refuses it, not the learner's first step."""
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", str(tmp_path / "data"), "--epsilon", "1.0"), "learner.eps_low", "less than 1"
    )
    assert snapshot_of(tmp_path) == before


def test_help_has_an_example_and_readable_defaults() -> None:
    for command in ("start", "config", "status", "plan", "dashboard", "eval", "report"):
        shown = run("hub.cli", command, "--help")
        assert shown.returncode == 0 and f"example:\n  echo-hub {command}" in shown.stdout, (command, shown.stdout[-500:])
    for command in ("join", "dashboard"):
        assert f"example:\n  echo-node {command}" in run("node.cli", command, "--help").stdout
    text = " ".join(run("hub.cli", "start", "--help").stdout.split())
    assert "('none',)" not in text and "()" not in text and "default False" not in text
    assert "(default none)" in text and "--chat CHAT render string prompts" in text and "(on or off) (default off)" in text
    assert "--group-size GROUP_SIZE, --num-generations GROUP_SIZE" in text
    assert "--lr-scheduler LR_SCHEDULER, --lr-scheduler-type LR_SCHEDULER" in text


def test_print_config_shows_what_a_start_would_run_with_and_writes_nothing(tmp_path: Path) -> None:
    toml = tmp_path / "hub.toml"
    toml.write_text("[learner]\nlr = 2e-5\ngroup_size = 4\n")
    data = tmp_path / "data"
    result = run("hub.cli", "start", "--config", str(toml), "--group-size", "6", "--data-dir", str(data), "--print-config")
    assert result.returncode == 0, result.stderr
    assert not data.exists()
    printed = tmp_path / "printed.toml"
    printed.write_text(result.stdout)
    from hub.config import HubConfig
    from shared.config import load_config

    config = load_config(HubConfig, printed, {})
    assert (config.learner.lr, config.learner.group_size, config.data_dir) == (2e-5, 6, data)


def test_a_config_from_a_pipe_is_read_by_the_process_that_runs() -> None:
    """`echo-hub start` runs itself again (glibc's heap) after checking its flags: a hub.toml that can be read once
    only, as from a pipe, must reach the process that runs, not be used up by the check."""
    result = subprocess.run(
        [sys.executable, "-m", "hub.cli", "start", "--config", "/dev/stdin", "--print-config"],
        input="[learner]\nstaleness = 5\n",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "\nstaleness = 5\n" in result.stdout


def test_a_users_model_gets_trls_defaults_for_what_was_not_set(tmp_path: Path) -> None:
    """--model of the user's own: TRL's max_completion_length, learning_rate and num_generations, each only where
    neither hub.toml (a TRL name counts) nor a flag set it, and one line naming those it took."""
    from hub.cli.main import _flat_keys, _own_model
    from hub.config import HubConfig, with_user_model_defaults
    from shared.config import load_config
    from shared.default_model import default_model_dir

    toml = tmp_path / "hub.toml"
    toml.write_text("learning_rate = 2e-5\n")
    config = load_config(HubConfig, toml, {"model": tmp_path / "mine"}, aliases=_flat_keys())
    own, line = with_user_model_defaults(config, own_model=True)
    assert (own.sampling.max_new_tokens, own.learner.lr, own.learner.group_size) == (512, 2e-5, 8)
    assert own.sampling.temperature == config.sampling.temperature and own.learner == config.learner.model_copy(
        update={"group_size": 8}
    )
    assert line == (
        "your own model: TRL's defaults --max-new-tokens 512, --group-size 8 (the embedded toy's are for its 2-layer "
        "model; a hub.toml line or a flag overrides one)"
    )
    assert with_user_model_defaults(own, own_model=True) == (own, None)  # all three set now: nothing more to say
    flags = {"sampling.max_new_tokens": 64, "learner.group_size": 4}
    config = load_config(HubConfig, toml, flags, aliases=_flat_keys())
    assert with_user_model_defaults(config, own_model=True) == (config, None)
    assert with_user_model_defaults(HubConfig(), own_model=False) == (HubConfig(), None)
    # One sampling flag leaves the section's other fields at their defaults (--top-p once made max_new_tokens 16).
    assert load_config(HubConfig, None, {"sampling.top_p": 0.9}).sampling.max_new_tokens == HubConfig().sampling.max_new_tokens
    assert _own_model(tmp_path / "mine", "reverse") and not _own_model(None, "reverse")
    assert not _own_model(default_model_dir(), "reverse") and _own_model(default_model_dir(), "calc")  # calc's is another

    result = run("hub.cli", "start", "--model", str(tmp_path / "mine"), "--max-completion-length", "64", "--print-config")
    assert result.returncode == 0, result.stderr
    assert {"lr = 1e-06", "max_new_tokens = 64", "group_size = 8"} <= set(result.stdout.splitlines())
