"""Every mistake a new user made, replayed through the real CLIs: one line on stderr that names the value and
what to do, exit code 2, no traceback, and the data dir untouched. Also: one hub per data dir, a resume
that says what it resumes and refuses another model or task, a node that says what it waits for, and
the example config that `echo-hub config` prints."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.harness import free_port, start_hub, wait_until

ROOT = Path(__file__).resolve().parent.parent
HUB_ID = "12D3KooWBQfx3WEjxhccpcx6oocrexqynsmUXa6uBjuKgWdjmdLR"


def run(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def snapshot_of(path: Path) -> list[tuple[str, int, float]] | None:
    """What a directory holds (names, sizes, times): None when it does not exist."""
    if not path.exists():
        return None
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime) for p in path.rglob("*"))


def assert_one_line_mistake(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout[-1000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "empty-model").mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{not json\n')
    (tmp_path / "unknown-key.toml").write_text("staleness = 6\n[learner]\nfoo = 1\n")
    (tmp_path / "flat-key.toml").write_text("audit_rate = 0.1\n")
    return {
        name.replace("-", "_").replace(".", "_"): tmp_path / name
        for name in ("empty-model", "a-file", "bad.jsonl", "unknown-key.toml", "flat-key.toml")
    }


HUB_MISTAKES = {
    "missing model dir": (["--model", "{tmp}/no-such-model"], ["--model", "no such directory"]),
    "empty model dir": (["--model", "{empty_model}"], ["--model", "config.json"]),
    "missing math file": (["--task", "math:{tmp}/missing.jsonl"], ["--task", "no such file"]),
    "malformed math line": (["--task", "math:{bad_jsonl}"], ["bad.jsonl:2", "not valid JSON"]),
    "unknown task module": (["--task", "nosuchmodule:Class"], ["--task", "nosuchmodule"]),
    "data dir is a file": (["--data-dir", "{a_file}"], ["--data-dir", "is a file"]),
    "data dir inside a file": (["--data-dir", "{a_file}/sub"], ["--data-dir", "is a file"]),
    "garbage listen address": (["--listen", "garbage"], ["--listen", "'garbage'"]),
    "dns listen address": (["--listen", "/dns4/localhost/tcp/0"], ["--listen", "give an /ip4/ or /ip6/ address"]),
    "quic listen address": (["--listen", "/ip4/127.0.0.1/udp/0/quic-v1"], ["--listen", "not a TCP listen address"]),
    "websocket listen address": (["--listen", "/ip4/127.0.0.1/tcp/0/ws"], ["--listen", "plain TCP", "drop /ws"]),
    "kappa out of range": (["--staleness", "1", "--kappa", "3"], ["kappa"]),
    "unknown key in hub.toml": (["--config", "{unknown_key_toml}"], ["unknown key 'foo' in [learner]"]),
    "flat key of a section with no flag": (["--config", "{flat_key_toml}"], ["'audit_rate' belongs in section [trust]"]),
    "negative learning rate": (["--lr", "-1"], ["learner.lr", "greater than 0"]),
    "bulk port out of range": (["--bulk-port", "70000"], ["broadcast.bulk_port", "65535"]),
    "bulk port = libp2p port": (
        ["--listen", "/ip4/127.0.0.1/tcp/4391", "--bulk-port", "4391"],
        ["--bulk-port 4391", "libp2p listen port", "--bulk-port 4392"],
    ),
    "flex attention on a CPU": (
        ["--attention", "flex_attention", "--device", "cpu"],
        ["--attention flex_attention trains on CUDA only", "--attention sdpa"],
    ),
    "flash attention not installed": (["--attention", "flash_attention_2"], ["flash-attn", "--attention flex_attention"]),
    "unknown optimizer": (["--optimizer", "sgd"], ["learner.optimizer", "adamw8bit"]),
    "reward that raises": (
        ["--task", "testbed.tasks:RaisingRewardTask"],
        ["reward testbed.tasks:RaisingRewardTask.rewards raised KeyError", "fix the reward"],
    ),
    "reward that returns NaN": (
        ["--task", "testbed.tasks:NanRewardTask"],
        ["reward testbed.tasks:NanRewardTask.rewards returned nan", "finite"],
    ),
    "reward with one value per group": (
        ["--task", "testbed.tasks:OneRewardTask", "--group-size", "4"],
        ["reward testbed.tasks:OneRewardTask.rewards returned 1 value for 4 completions"],
    ),
}


@pytest.mark.parametrize("mistake", HUB_MISTAKES)
def test_echo_hub_start_mistakes_are_one_line_and_touch_nothing(mistake: str, files, tmp_path: Path) -> None:
    args, words = HUB_MISTAKES[mistake]
    names = {"tmp": str(tmp_path), **{k: str(v) for k, v in files.items()}}
    args = [a.format(**names) for a in args]
    data_dir = tmp_path / "data"
    if "--data-dir" not in args:
        args += ["--data-dir", str(data_dir)]
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(run("hub.cli", "start", "--local-nodes", "0", *args), *words)
    assert snapshot_of(tmp_path) == before  # nothing created, nothing written


def test_a_port_already_in_use_is_named_with_a_free_one_to_try(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = assert_one_line_mistake(
            run("hub.cli", "start", "--data-dir", str(tmp_path / "d"), "--listen", f"/ip4/127.0.0.1/tcp/{port}"), "already in use"
        )
    assert f"/ip4/127.0.0.1/tcp/{port + 1}" in line and not (tmp_path / "d").exists()


@pytest.mark.parametrize("command", ["hub", "node"])
def test_a_bulk_port_already_in_use_is_named(command: str, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--data-dir", str(tmp_path / "d"), "--listen", "/ip4/127.0.0.1/tcp/0", "--bulk-port", str(port)]
        if command == "hub":
            result = run("hub.cli", "start", "--local-nodes", "0", *args)
        else:
            result = run("node.cli", "join", "--hub", f"/ip4/127.0.0.1/tcp/4077/p2p/{HUB_ID}", *args)
        line = assert_one_line_mistake(result, f"--bulk-port {port}", "already in use", str(port + 1))
    assert line and not (tmp_path / "d").exists()


NODE_MISTAKES = {
    "garbage hub address": (["--hub", "garbage"], ["--hub", "not a hub address"]),
    "hub address without /p2p/": (["--hub", "/ip4/127.0.0.1/tcp/4077"], ["--hub", "lacks the hub's peer id", "/p2p/"]),
    "empty model dir": (
        ["--hub", f"/ip4/127.0.0.1/tcp/4077/p2p/{HUB_ID}", "--model", "{empty_model}"],
        ["--model", "config.json"],
    ),
    "data dir is a file": (
        ["--hub", f"/ip4/127.0.0.1/tcp/4077/p2p/{HUB_ID}", "--data-dir", "{a_file}"],
        ["--data-dir", "is a file"],
    ),
    "bulk port below -1": (["--hub", f"/ip4/127.0.0.1/tcp/4077/p2p/{HUB_ID}", "--bulk-port", "-2"], ["bulk_port", "-1"]),
    "a price in another unit": (
        ["--hub", f"/ip4/127.0.0.1/tcp/4077/p2p/{HUB_ID}", "--price", "0.0001"],
        ["--price 0.0001", "$ per hour", "give 0 to volunteer for free"],
    ),
}


@pytest.mark.parametrize("mistake", NODE_MISTAKES)
def test_echo_node_join_mistakes_are_one_line_and_touch_nothing(mistake: str, files, tmp_path: Path) -> None:
    args, words = NODE_MISTAKES[mistake]
    args = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    if "--data-dir" not in args:
        args += ["--data-dir", str(tmp_path / "node")]
    before = snapshot_of(tmp_path)
    assert_one_line_mistake(run("node.cli", "join", *args), *words)
    assert snapshot_of(tmp_path) == before


def test_a_hub_that_does_not_answer_is_one_line_without_libp2p_noise() -> None:
    result = run("hub.cli", "status", "--hub", f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{HUB_ID}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "no answer from" in result.stderr


def test_status_and_dashboard_mistakes_are_one_line(tmp_path: Path) -> None:
    assert_one_line_mistake(run("hub.cli", "status", "--hub", "garbage"), "--hub", "not a hub address")
    assert_one_line_mistake(run("hub.cli", "dashboard", "--hub", "/ip4/1.2.3.4/tcp/1"), "--hub", "peer id", "/p2p/")
    assert_one_line_mistake(run("hub.cli", "status", "--data-dir", str(tmp_path)), "status.json", "--data-dir")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_hub_per_data_dir_and_a_resume_that_says_what_it_resumes(tmp_path: Path) -> None:
    data, port = tmp_path / "data", free_port()
    hub = start_hub(data, "--local-nodes", "0", "--steps", "0", port=port)
    try:
        # A second hub on the same data dir is refused, naming the one that holds it.
        second = run(
            "hub.cli", "start", "--data-dir", str(data), "--local-nodes", "0", "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}"
        )
        assert_one_line_mistake(second, "another hub", f"pid {hub.process.pid}")
        assert (data / "hub.lock").read_text().strip() == str(hub.process.pid)
        # Plain progress lines, since its output is a file, not a terminal.
        wait_until(lambda: " step 0/∞ " in hub.output(), 30, "a plain progress line")
    finally:
        assert hub.stop() in (0, 130)
    # Another task on this run's data dir: refused with both ways out, nothing touched.
    before = snapshot_of(data)
    changed = run("hub.cli", "start", "--data-dir", str(data), "--local-nodes", "0", "--task", "testbed.tasks:EchoTask")
    assert_one_line_mistake(changed, "another task", "--fresh", "--resume-anyway")
    assert snapshot_of(data) == before
    # Evaluation newly on: a held-out split would take prompts the run may have trained on.
    held = run("hub.cli", "start", "--data-dir", str(data), "--local-nodes", "0", "--eval-every", "5")
    assert_one_line_mistake(held, "another held-out prompts", "'none'", "--fresh")
    assert snapshot_of(data) == before
    # The same run again: it says what it resumes.
    hub = start_hub(data, "--local-nodes", "0", "--steps", "0", port=port)
    try:
        assert "resuming the run in" in hub.output() and "at step 0" in hub.output()
    finally:
        hub.stop()
    # --fresh starts over and keeps the old run aside.
    hub = start_hub(data, "--local-nodes", "0", "--steps", "0", "--fresh", "--task", "testbed.tasks:EchoTask", port=port)
    try:
        assert "the old run is now in" in hub.output()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("data.old-")]
    finally:
        hub.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_says_what_it_waits_for_and_stops_on_a_refusal_it_cannot_fix(tmp_path: Path) -> None:
    # Nothing listens there: the node says so, with its next try, instead of going silent.
    nowhere = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{HUB_ID}"
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node.cli",
            "join",
            "--hub",
            nowhere,
            "--data-dir",
            str(tmp_path / "n1"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--device",
            "cpu",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        started, lines = time.monotonic(), []
        while time.monotonic() - started < 60 and not any("next try in" in line for line in lines):
            lines.append(node.stdout.readline())
        assert any("unreachable" in line and "next try in" in line for line in lines), lines
    finally:
        node.kill()
        node.wait()
    # A price above the hub's ceiling will never be accepted: the node stops and says why.
    hub = start_hub(tmp_path / "hub", "--local-nodes", "0", "--steps", "0")
    try:
        refused = run(
            "node.cli",
            "join",
            "--hub",
            hub.addr,
            "--price",
            "50",
            "--data-dir",
            str(tmp_path / "n2"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--device",
            "cpu",
            timeout_s=100,
        )
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert "above this hub's ceiling" in refused.stderr and "--price" in refused.stderr
    finally:
        hub.stop()


def test_status_json_into_a_closed_pipe_is_not_a_traceback(tmp_path: Path) -> None:
    from tests.test_tui import hub_status, write_status

    write_status(tmp_path, hub_status())
    shell = f"{sys.executable} -m hub.cli status --json --data-dir {tmp_path} | head -1"
    result = subprocess.run(shell, shell=True, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.stdout.strip() == "{" and "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_the_example_config_is_what_echo_hub_config_prints_and_it_loads(tmp_path: Path) -> None:
    printed = run("hub.cli", "config")
    assert printed.returncode == 0
    assert printed.stdout == (ROOT / "docs" / "hub.example.toml").read_text(), (
        "regenerate: echo-hub config > docs/hub.example.toml"
    )
    from hub.config import HubConfig
    from shared.config import load_config

    assert load_config(HubConfig, ROOT / "docs" / "hub.example.toml", {}) == HubConfig()
    # Every field is there, with its help line.
    for section in ("learner", "sampling", "lease", "broadcast", "scheduler", "trust"):
        assert f"[{section}]" in printed.stdout
    assert (
        '# S: max versions a trajectory may lag the learner ("auto": adapt it, see staleness_auto)\n# staleness = 4\n'
        in printed.stdout
    )


def test_echo_hub_config_plus_a_model_of_ones_own_takes_the_user_model_defaults(tmp_path: Path) -> None:
    """`echo-hub config > hub.toml` with `model = ...` added: the file sets nothing else, so the start takes TRL's
    defaults and says so in its line; a line uncommented in the file wins over them (`--print-config`: the config
    the start resolves, through the start's own path)."""
    import re
    import tomllib

    from hub.config import HubConfig
    from testbed.models import random_model_dir

    model = random_model_dir(tmp_path / "mine", "qwen3", hidden=64, layers=2)
    written = run("hub.cli", "config")
    assert written.returncode == 0, written.stderr
    hub_toml = tmp_path / "hub.toml"
    hub_toml.write_text(re.sub(r"^# model = $", f"model = {str(model)!r}", written.stdout, count=1, flags=re.M))
    resolved = run("hub.cli", "start", "--config", str(hub_toml), "--print-config")
    assert resolved.returncode == 0, resolved.stderr
    effective = tomllib.loads(resolved.stdout)
    assert effective["model"] == str(model)
    assert (effective["learner"]["lr"], effective["learner"]["group_size"], effective["sampling"]["max_new_tokens"]) == (
        1e-6,
        8,
        512,
    )
    assert "echo-hub: your own model: TRL's defaults --max-new-tokens 512, --lr 1e-06, --group-size 8 (" in resolved.stderr
    # Uncommented as it was written, the toy's lr is set: it wins, and the line no longer names it.
    hub_toml.write_text(re.sub(r"^# (lr = )", r"\1", hub_toml.read_text(), count=1, flags=re.M))
    resolved = run("hub.cli", "start", "--config", str(hub_toml), "--print-config")
    assert resolved.returncode == 0, resolved.stderr
    effective = tomllib.loads(resolved.stdout)
    assert (effective["learner"]["lr"], effective["sampling"]["max_new_tokens"]) == (HubConfig().learner.lr, 512)
    assert "TRL's defaults --max-new-tokens 512, --group-size 8 (" in resolved.stderr and "--lr" not in resolved.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_learner_that_stalls_while_work_arrives_says_why(tmp_path: Path) -> None:
    config = tmp_path / "hub.toml"
    config.write_text("[learner]\nstall_warning_s = 1.0\n")
    hub = start_hub(tmp_path / "data", "--local-nodes", "1", "--task", "testbed.tasks:FlatTask", "--config", str(config))
    try:
        line = wait_until(
            lambda: next((ln for ln in hub.output().splitlines() if "warning: no learner step" in ln), None),
            120,
            "the stall warning",
        )
        assert "had equal rewards" in line and "--group-size" in line
    finally:
        hub.stop()


def test_version_flags_print_the_installed_version() -> None:
    from importlib.metadata import version

    for module, name in (("hub.cli", "echo-hub"), ("node.cli", "echo-node")):
        result = run(module, "--version")
        assert result.returncode == 0 and result.stdout.strip() == f"{name} {version('echo2')}", result


def test_compile_on_a_cpu_without_a_cpp_compiler_is_one_line(monkeypatch) -> None:
    from hub.cli import preflight
    from hub.config import HubConfig
    from shared.checks import UserError

    config = HubConfig.model_validate({"learner": {"compile": True, "device": "cpu"}})
    preflight.check_learner_kernels(config)  # this machine has g++
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match=r"--compile on a CPU needs a C\+\+ compiler"):
        preflight.check_learner_kernels(config)
