"""A hub that stops other than by finishing says so in one line, and `echo-hub status` tells the truth about it
afterwards: a SIGKILLed hub is "stopped (last seen ...)", Ctrl-C while it builds its model is one line and exit
130, a full disk stops the run with one line naming the data dir and its free space, and the filesystem's refusals
(a name too long for `--fresh`, a read-only data dir for `echo-hub report`) are one line, exit 2.

Real `echo-hub` processes; the full disk and the read-only dir are real tmpfs mounts (skipped where mounting is
not permitted)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.harness import start_hub, wait_until
from tests.test_first_contact import HUB_ID, ROOT, assert_one_line_mistake, run


def assert_one_line(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert result.returncode == code, (result.returncode, result.stdout[-1000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def state_line(printed: str) -> str:
    """The "state" row of `echo-hub status`."""
    return next(line for line in printed.splitlines() if line.startswith("state "))


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` for the test's duration; skips the test where mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a real full disk needs a tmpfs mount, refused here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow
def test_status_of_a_sigkilled_hub_says_stopped_and_when_it_was_last_seen(tmp_path: Path) -> None:
    data = tmp_path / "data"
    hub = start_hub(data, "--local-nodes", "0", "--steps", "0")
    try:
        wait_until(lambda: (s := hub.status()) is not None and s.running, 30, "the hub to write its status")
        live = run("hub.cli", "status", "--data-dir", str(data))
        assert live.returncode == 0 and state_line(live.stdout).split()[1:] == ["running"], live.stdout + live.stderr
    finally:
        hub.kill()  # SIGKILL: nothing of the hub runs to say it stopped
    assert hub.status().running  # what the hub last wrote
    dead = run("hub.cli", "status", "--data-dir", str(data))
    assert dead.returncode == 0, dead.stderr
    state = state_line(dead.stdout)
    assert "stopped (last seen " in state and " s ago)" in state, dead.stdout
    as_json = run("hub.cli", "status", "--json", "--data-dir", str(data))
    assert json.loads(as_json.stdout)["running"] is False
    assert "stopped (last seen " in as_json.stderr


def test_the_state_status_prints_follows_the_lock_holder_and_the_status_age(tmp_path: Path) -> None:
    from hub.cli.status import run_state
    from tests.test_tui import hub_status

    now = time.time()
    fresh = hub_status().model_copy(update={"running": True, "updated_at": now - 1})
    stale = fresh.model_copy(update={"updated_at": now - 125})
    assert run_state(fresh, tmp_path, now) == "running"  # no lock file: a fresh status is believed
    assert run_state(stale, tmp_path, now).startswith("stopped (last seen ")
    assert run_state(stale, tmp_path, now).endswith(", 2 min 05 s ago)")
    from shared.lock import lock_data_dir

    held = lock_data_dir(tmp_path, "hub.lock", "hub")  # a live holder: running, however old its status
    assert run_state(fresh, tmp_path, now) == "running"
    assert run_state(stale, tmp_path, now) == f"running (pid {os.getpid()}; status not rewritten for 2 min 05 s)"
    held.close()  # as its process dying releases it: the pid still in the file does not make it run
    assert (tmp_path / "hub.lock").read_text().strip() == str(os.getpid())
    assert run_state(fresh, tmp_path, now).startswith("stopped (last seen ")
    done = fresh.model_copy(update={"running": False, "step": fresh.steps_target})
    assert run_state(done, tmp_path, now) == "finished"
    assert run_state(done.model_copy(update={"step": done.steps_target - 1}), tmp_path, now) == "stopped"


@pytest.mark.slow
@pytest.mark.parametrize("local_nodes", ["0", "1"])
def test_ctrl_c_while_the_hub_builds_its_model_is_one_line_and_exit_130(tmp_path: Path, local_nodes: str) -> None:
    """With local nodes, their node server (a forkserver) is importing torch and libp2p when the Ctrl-C comes:
    it ignores it (the hub stops it), so its import tracebacks do not surround the one line."""
    data = tmp_path / "data"
    hub = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hub.cli",
            "start",
            "--data-dir",
            str(data),
            "--local-nodes",
            local_nodes,
            "--steps",
            "0",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        # hub.log opens just before torch is imported and the model built: Ctrl-C lands in the build.
        wait_until(lambda: (data / "hub.log").exists() or hub.poll() is not None, 60, "the hub to open its log", poll_s=0.02)
        time.sleep(0.3)
        hub.send_signal(signal.SIGINT)
        out, err = hub.communicate(timeout=60)
    finally:
        if hub.poll() is None:
            hub.kill()
            hub.wait()
    assert "listening on" not in out, "the hub started before the Ctrl-C: the test missed the model build"
    if local_nodes == "0":
        assert_one_line(subprocess.CompletedProcess(hub.args, hub.returncode, out, err), 130, "Ctrl-C", "start it again")
        return
    # The node server's imports may still print this machine's library warnings (torchao's, say) as it exits:
    # not ours to silence; its tracebacks are.
    assert hub.returncode == 130 and "Traceback" not in err + out, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("echo-hub")] == [
        "echo-hub: stopped by Ctrl-C; start it again to go on"
    ], err[-3000:]


@pytest.mark.slow
def test_ctrl_c_mid_run_with_a_users_reward_is_one_line(tmp_path: Path) -> None:
    """A user's reward runs in check processes and the local node in a forkserver's child: Ctrl-C reaches the whole
    foreground group, and only the hub says anything (the trial saw `Process echo2-check:` and 15 lines)."""
    (tmp_path / "rw.py").write_text("def reward(completions, **kwargs):\n    return [float(len(c) % 3) for c in completions]\n")
    data = tmp_path / "data"
    hub = subprocess.Popen(
        [sys.executable, "-m", "hub.cli", "start", "--data-dir", str(data), "--reward", "rw:reward", "--local-nodes", "1"]
        + ["--steps", "0", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,  # its own foreground group, as a terminal's Ctrl-C signals every process of it
    )
    try:
        metrics = data / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and metrics.stat().st_size > 0 or hub.poll() is not None, 240, "a first step")
        os.killpg(hub.pid, signal.SIGINT)
        out, err = hub.communicate(timeout=120)
    finally:
        if hub.poll() is None:
            os.killpg(hub.pid, signal.SIGKILL)
            hub.wait()
    assert hub.returncode == 130, err[-3000:]
    assert "Traceback" not in err + out and "Process echo2-check" not in err, err[-3000:]
    # The node server's imports may print this machine's library warnings (torchao's): not ours to silence.
    assert [line for line in err.splitlines() if line.startswith(("echo-hub", "echo-node"))] == [
        "echo-hub: SIGINT: 1 local nodes stopped; saving state"
    ], err[-3000:]


CLI_MODULES = {"hub": "hub.cli.main", "node": "node.cli"}
CLI_ARGS = {"hub": ["start"], "node": ["join", "--hub", f"/ip4/127.0.0.1/tcp/1/p2p/{HUB_ID}", "--data-dir", "node"]}
CLI_START_STEPS = {"hub": "_start", "node": "check_join"}  # a step of each CLI's start-up, inside its Ctrl-C line


def run_patched_cli(tmp_path: Path, cli: str, building: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`cli`'s main() under `python -m`, its start-up step replaced by the function `building` that the code
    `building` defines (it may call `original`, the step it replaces)."""
    step = CLI_START_STEPS[cli]
    (tmp_path / "patched.py").write_text(
        "import os, signal, sys, time\n"
        "import shared.signals  # imported first: an import that runs exec would itself clear CPython's flag\n"
        f"import {CLI_MODULES[cli]} as cli\n"
        f"original = cli.{step}\n"
        f"{building}\n"
        f"cli.{step} = building\n"
        f"sys.exit(cli.main({CLI_ARGS[cli]!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "patched"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize("cli", ["hub", "node"])
def test_ctrl_c_raised_inside_exec_still_exits_130_under_python_m(tmp_path: Path, cli: str) -> None:
    """CI once saw exit -2 (death by SIGINT) after the one line: the Ctrl-C landed while a dataclass built its
    methods with exec, which leaves CPython's "unhandled Ctrl-C" flag set although main() caught it."""
    probe = run_patched_cli(tmp_path, cli, "def building(*args, **kwargs):\n    exec('raise KeyboardInterrupt')")
    assert probe.returncode == 130, (probe.returncode, probe.stderr[-2000:])
    assert "Ctrl-C" in probe.stderr or "interrupted" in probe.stderr


@pytest.mark.parametrize("ctrl_c", [True, False], ids=["ctrl-c", "no-ctrl-c"])
@pytest.mark.parametrize("cli", ["hub", "node"])
def test_ctrl_c_a_library_turned_into_another_error_exits_130_and_that_error_alone_is_raised(
    tmp_path: Path, cli: str, ctrl_c: bool
) -> None:
    """CI once saw a traceback and exit 1: Ctrl-C cut `import numpy.dtypes` short, numpy's lazy attribute then
    recursed, and transformers reported "Could not import module 'Qwen2ForCausalLM'"; the interrupt was gone."""
    probe = run_patched_cli(
        tmp_path,
        cli,
        (
            "def building(*args, **kwargs):\n"
            "    try:\n"
            f"        if {ctrl_c}:\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "            time.sleep(30)  # the handler raises here\n"
            "    except KeyboardInterrupt:\n"
            "        pass  # as the library did\n"
            "    raise ModuleNotFoundError(\"Could not import module 'Qwen2ForCausalLM'\")"
        ),
    )
    if ctrl_c:
        assert probe.returncode == 130, (probe.returncode, probe.stderr[-2000:])
        assert len(probe.stderr.strip().splitlines()) == 1, probe.stderr[-2000:]
    else:  # our own errors propagate: only a Ctrl-C explains them away
        assert probe.returncode == 1 and "Qwen2ForCausalLM" in probe.stderr and "Traceback" in probe.stderr


def test_ctrl_c_a_library_swallowed_without_a_trace_still_stops_the_node_before_it_joins(tmp_path: Path) -> None:
    probe = run_patched_cli(
        tmp_path,
        "node",
        (
            "def building(config):\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        time.sleep(30)  # the handler raises here\n"
            "    except KeyboardInterrupt:\n"
            "        pass  # and nothing follows from it\n"
            "    original(config)"
        ),
        timeout_s=120,
    )
    # Without the watch it would dial the hub (retrying for ever) as if no Ctrl-C had come.
    assert probe.returncode == 130, (probe.returncode, probe.stdout[-2000:], probe.stderr[-2000:])
    assert probe.stderr.strip() == "echo-node: interrupted before it joined", probe.stderr[-2000:]


def fill(path: Path) -> None:
    """Write zeros to `path` until its disk is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_status_says_stopped(tmp_path: Path) -> None:
    # 8 MB: the hub's first snapshot (4.2 MB) fits; then another program fills the disk, and the hub's next write
    # (its status, once a second) finds it full. A node's copy no longer fills it: a node checks that a snapshot fits
    # its free disk before it writes a byte of it (tests/test_snapshot.py).
    with tmpfs(tmp_path / "small", "8m") as small:
        data = small / "data"
        hub = start_hub(data, "--local-nodes", "0", "--steps", "20", "--prompts-per-step", "4", "--group-size", "4")
        try:
            wait_until(lambda: (s := hub.status()) is not None and s.running, 60, "the hub to write its status")
            fill(small / "filler")
            code = hub.process.wait(timeout=60)
        finally:
            hub.kill()
        output = hub.output()
        assert code == 2, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        line = output.strip().splitlines()[-1]
        assert "full" in line and str(data) in line and "MB free" in line and "start it again" in line, line
        status = run("hub.cli", "status", "--data-dir", str(data))
        assert status.returncode == 0, status.stderr
        assert state_line(status.stdout).split()[1] == "stopped", status.stdout
        assert not list(data.rglob(".*.tmp")), "a failed status write left its temp file"


def test_fresh_on_a_data_dir_whose_old_run_name_is_too_long_is_one_line(tmp_path: Path) -> None:
    # 240 characters: a legal name, but the old run's name (+ ".old-<time>") is past the filesystem's 255.
    data = tmp_path / ("d" * 240)
    data.mkdir()
    (data / "hub.sqlite").write_text("")
    result = run("hub.cli", "start", "--data-dir", str(data), "--fresh", "--local-nodes", "0")
    assert_one_line_mistake(result, "--fresh", "too long", "--data-dir")
    assert (data / "hub.sqlite").exists()


def test_a_data_dir_name_too_long_for_the_filesystem_is_one_line(tmp_path: Path) -> None:
    result = run("hub.cli", "start", "--data-dir", str(tmp_path / ("e" * 300)), "--fresh", "--local-nodes", "0")
    assert_one_line_mistake(result, "--data-dir", "too long")


def test_report_on_a_read_only_data_dir_is_one_line(tmp_path: Path) -> None:
    row = {"step": 1, "reward_mean": 0.5, "rollout_reward_mean": 0.5, "staleness_mean": 0.0, "staleness_max": 0, "bubble": 0.1}
    if os.geteuid() != 0:
        data = tmp_path / "data"
        data.mkdir()
        (data / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        data.chmod(0o555)
        result = run("hub.cli", "report", "--data-dir", str(data))
    else:  # root writes through file modes: a read-only mount
        with tmpfs(tmp_path / "ro", "1m") as data:
            (data / "metrics.jsonl").write_text(json.dumps(row) + "\n")
            subprocess.run(["mount", "-o", "remount,ro", str(data)], check=True)
            result = run("hub.cli", "report", "--data-dir", str(data))
    assert_one_line_mistake(result, "report.png", "--out")


def test_a_disk_that_fills_while_the_hub_starts_is_one_line_and_other_errors_stay_tracebacks(
    tmp_path, monkeypatch, capsys
) -> None:
    import errno

    import hub.cli.run
    from hub.cli.main import main

    data = tmp_path / "data"
    argv = ["start", "--data-dir", str(data), "--local-nodes", "0", "--listen", "/ip4/127.0.0.1/tcp/0"]

    def fails(code: int):
        def run_hub(*args, **kwargs):  # the store's first write, injected where run_hub builds the hub
            raise OSError(code, os.strerror(code), str(data / "hub.sqlite"))

        return run_hub

    monkeypatch.setattr(hub.cli.run, "run_hub", fails(errno.ENOSPC))
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"--data-dir {data} is full" in lines[0] and "MB free" in lines[0], lines
    monkeypatch.setattr(hub.cli.run, "run_hub", fails(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        main(argv)


@pytest.mark.parametrize("how", ["forked", "command_line"])
def test_a_process_whose_stop_hangs_leaves_its_stacks_in_its_output(tmp_path: Path, how: str) -> None:
    """CI once killed a hub that had not stopped 30 s after its Ctrl-C, and nothing said what it waited for. The
    test bed now aborts a hung process before it kills it, and faulthandler writes where every thread was."""
    from testbed import forked
    from testbed.harness import Proc, _env

    log = tmp_path / "out.log"
    script = ROOT / "tests" / "data" / "hangs_on_stop.py"
    if how == "forked":
        process: subprocess.Popen | forked.Forked = forked.spawn("tests.data.hangs_on_stop", [], str(log), _env())
    else:
        with log.open("wb") as out:
            process = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, env=_env())
    proc = Proc(process, log)
    wait_until(lambda: "ready" in proc.output() or None, 60, "the process to start")
    assert proc.stop(timeout_s=1.0) == -signal.SIGABRT
    assert "held_where_the_stop_waits" in proc.output(), proc.output()
