"""The volunteer node's own edges: another peer answering at the hub's address, an engine this machine cannot run,
one node per data dir, Ctrl-C with the dashboard open, and the summary a stopped node prints. Through real
`echo-node join` processes where the behaviour is the process's (exit codes, stderr, signals, a terminal)."""

from __future__ import annotations

import logging
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import trio

from node.client import HubClient, WrongHub
from node.hub_link import HubLink
from node.summary import summary_text
from shared.crypto import Identity
from shared.layout import NODE_LOCK_FILE, NODE_STATUS_FILE
from shared.messages import Heartbeat, JoinReply, JoinRequest, NodeView, Reject, RejectCode, Tallies
from shared.net import running_host
from testbed.harness import free_port, start_hub, wait_until
from tests.test_first_contact import HUB_ID, ROOT, assert_one_line_mistake, run
from tui.cli import run_node_dashboard

NOWHERE = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{HUB_ID}"


def join_args(hub: str, data_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "node.cli",
        "join",
        "--hub",
        hub,
        "--data-dir",
        str(data_dir),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--bulk-port",
        "-1",
        *args,
    ]


# -- 41.8: an engine this machine cannot run is one line, before anything is written ---------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(tmp_path: Path, capsys) -> None:
    from node.cli import main

    assert main(["join", "--hub", NOWHERE, "--device", "cuda", "--data-dir", str(tmp_path / "node")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0] and "--device cpu" in err[0], err
    assert not (tmp_path / "node").exists()
    # (--backend vllm without vLLM: tests/test_engine.py)


@pytest.mark.slow
def test_ctrl_c_while_the_node_builds_its_engine_is_one_line(tmp_path: Path, default_model_dir: Path) -> None:
    data = tmp_path / "node"
    # With --model the engine is built right after the lock (without it the node first fetches the hub's files).
    node = subprocess.Popen(
        join_args(NOWHERE, data, "--device", "cpu", "--model", str(default_model_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        # The lock is taken just before torch is imported and the engine built: seconds before it joins.
        wait_until(lambda: (data / NODE_LOCK_FILE).exists(), 60, "the node to lock its data dir")
        node.send_signal(signal.SIGINT)
        out, err = node.communicate(timeout=60)
    finally:
        node.kill()
        node.wait()
    if "joining" in out:
        pytest.skip("the engine was built before the signal arrived")  # then it is test_a_real_node_...'s SIGINT
    assert node.returncode == 130 and err.strip() == "echo-node: interrupted before it joined", err[-2000:]


# -- 41.7: another peer at the hub's address is named, not "unreachable" ------------------------------------


def test_another_peer_at_the_hub_address_is_named_by_the_client() -> None:
    wanted = Identity.generate().peer_id

    async def dial() -> WrongHub:
        answering = Identity.generate()
        async with running_host(answering, ["/ip4/127.0.0.1/tcp/0"]) as (_, addrs):
            transport = addrs[0].partition("/p2p/")[0]
            me = Identity.generate()
            async with running_host(me, ["/ip4/127.0.0.1/tcp/0"]) as (host, _):
                with pytest.raises(WrongHub) as caught:
                    await HubClient(host, me, f"{transport}/p2p/{wanted}").connect()
        assert caught.value.answered == answering.peer_id and caught.value.transport == transport
        return caught.value

    wrong = trio.run(dial)
    line = str(wrong)
    assert f"(peer id {wrong.answered}, not {wanted})" in line
    assert "another peer answered at /ip4/127.0.0.1/tcp/" in line and "check the /p2p/ part of --hub" in line


class _SwappedHub:
    """A client whose hub answers one join, then goes away and another peer answers at its address."""

    hub_peer_id = HUB_ID

    def __init__(self) -> None:
        self.connects = 0

    async def connect(self) -> None:
        self.connects += 1
        if self.connects > 1:
            raise WrongHub("/ip4/127.0.0.1/tcp/4077", HUB_ID, "12D3KooWOther")

    async def join(self, request: JoinRequest) -> JoinReply:
        return JoinReply(state="active", latest_version=0, staleness=1, task="t", heartbeat_period_s=0.05, context_tokens=64)

    async def heartbeat(self, beat: Heartbeat):
        raise OSError("connection closed")


def test_another_peer_after_a_join_is_a_clear_line_and_the_node_keeps_trying() -> None:
    client = _SwappedHub()
    link = HubLink(client, lambda: None, lambda: Heartbeat(version_held=-1), lambda reply: None, backoff_max_s=0.05)

    async def main() -> None:
        with trio.move_on_after(2):
            await link.run()

    trio.run(main)
    assert client.connects >= 3  # still trying: the hub may come back at that address
    wrong = [e for e in link.state.events if e.kind == "wrong_peer"]
    assert wrong and "another peer answered at /ip4/127.0.0.1/tcp/4077" in wrong[0].detail
    assert not any(e.kind == "unreachable" for e in link.state.events)


# -- issue 65: a hostile hub's words reach the volunteer's terminal and log cleaned ---------------------------------

# Window title, clipboard write, screen clear, a C1 control: what a hub's text carried to a volunteer's terminal.
ESCAPES = "\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x9b31m"


class _HostileHub:
    """A hub whose every text carries escape sequences: its task, a busy heartbeat's reason, a lease refusal, a ban."""

    hub_peer_id = HUB_ID

    def __init__(self) -> None:
        self.beats = 0

    async def connect(self) -> None:
        pass

    async def join(self, request: JoinRequest) -> JoinReply:
        return JoinReply(state="active", latest_version=0, staleness=1, task=ESCAPES, heartbeat_period_s=0.01, context_tokens=64)

    async def heartbeat(self, beat: Heartbeat) -> Reject:
        self.beats += 1
        return Reject(code=RejectCode.BUSY if self.beats == 1 else RejectCode.BANNED, reason=ESCAPES)

    async def lease(self, version_held: int) -> Reject:
        return Reject(code=RejectCode.BUSY, reason=ESCAPES)


def test_a_hubs_escape_sequences_never_reach_the_terminal_or_the_log(capsys, caplog) -> None:
    from node.run import _print_event, _run_phase
    from node.worker import Worker

    caplog.set_level(logging.DEBUG)
    client = _HostileHub()
    link = HubLink(client, lambda: None, lambda: Heartbeat(version_held=-1), lambda reply: None, backoff_max_s=0.05)
    link.state.on_note = _print_event
    worker = Worker(client, None, None, lambda: True, lambda: 0, None)  # type: ignore[arg-type]

    async def main() -> None:
        await worker.next_lease()
        await link.run()

    assert _run_phase(main) == 1  # the ban ends the node, in the hub's (cleaned) words
    printed = capsys.readouterr()
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "owned" in printed.out and "owned" in printed.err and "owned" in logged
    for text in (printed.out, printed.err, logged):
        assert not any(c in text for c in "\x1b\x07\x9b")


# -- 41.9: what a stopped node prints ------------------------------------------------------------------------


def test_the_summary_says_what_the_node_did() -> None:
    view = NodeView(
        peer_id="12D3KooWme",
        hub_addr=NOWHERE,
        connected=True,
        state="active",
        updated_at=0.0,
        price_per_hour=0.35,
        backend="hf",
        version_held=7,
        leases_done=12,
        tallies=Tallies(accepted=96, rejected=1, late=2, refused=0),
        earnings_usd=0.0123,
        paid_s=126.5,
        busy_s=190,
        versions_installed=4,
        relayed_bytes=12_300_000,
    )
    text = summary_text(view)
    for words in (
        "4 versions installed, holds v7",
        "12 leases",
        "accepted 96",
        "rejected 1",
        "late 2",
        "earnings   $0.0123 for 126.5 s paid at $0.35/h (the hub's measure",
        "busy       3 min 10 s generating (this node's own clock)",
        "12.3 MB of snapshots to this node's successors (unpaid: ",
    ):
        assert words in text, (words, text)
    # What went unpaid, and why: late groups with the pace the hub needs, rejections by reason, standby.
    told = view.model_copy(
        update={
            "reasons": {"late": 2, "tokens": 1},
            "needed_rollouts_per_s": 3.25,
            "rollouts_per_s": 1.5,
            "standby_s": 75.0,
            "measured_rollouts_per_s": 0.7,
        }
    )
    unpaid = [line for line in summary_text(told).splitlines() if line.startswith("  unpaid")]
    assert unpaid == [
        "  unpaid     2 late groups: your groups arrived after the hub moved on; this hub needs 3.25 rollouts/s per node "
        "(this node's last lease ran at 1.5)",
        "  unpaid     1 group rejected (tokens): a malformed completion (its length, log-probs, tokens after EOS, ids "
        "outside the vocabulary)",
        "  unpaid     1 min 15 s in standby: the hub ranks nodes by price per measured rollout/s: $0.35/h at 0.7 "
        "rollouts/s is $0.5/h per rollout/s, and nodes cheaper per rollout/s cover the throughput it needs",
    ]
    # Answers the hub never replied to: a line of their own (it may have paid them), none when there are none.
    assert "no reply" not in text
    cut = summary_text(view.model_copy(update={"unanswered": 1}))
    assert "  no reply   1 answer: the hub never replied (lost on the way, or cut off by the stop)" in cut
    # A hub that did not say the pace (none of its late verdicts could measure one): the late line still says why.
    assert "2 late groups: your groups arrived after the hub moved on; this hub needs a faster node" in text


# -- 41.9: Ctrl-C quits the dashboard (and with it the node it watches) --------------------------------------


@pytest.mark.asyncio
async def test_ctrl_c_quits_the_node_dashboard(tmp_path: Path) -> None:
    app = run_node_dashboard(tmp_path, refresh_s=0.1)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.loaded.wait()
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app._exit, "ctrl+c did not quit the dashboard"


def _on_a_terminal(argv: list[str]) -> tuple[int, int]:
    """Start `argv` on a new pseudo-terminal, in its own session: (pid, the terminal's fd)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.environ.update(TERM="xterm-256color", COLUMNS="100", LINES="30")
        os.execv(sys.executable, argv)
    return pid, fd


def _read_until(fd: int, done, timeout_s: float) -> bytes:
    """What the terminal shows until `done(output)` or the timeout (the process may exit meanwhile)."""
    out, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done(out):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:  # the process closed the terminal
                break
    return out


def _exit_code(pid: int, fd: int, timeout_s: float = 30) -> int | None:
    """The exit code of the process on the terminal; None (and its whole session killed) when it outlives the wait."""
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            waited, status = os.waitpid(pid, os.WNOHANG)
            if waited:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)  # the dashboard and the node under it
        os.waitpid(pid, 0)
        return None
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_in_the_dashboard_stops_the_node_and_prints_its_summary(tmp_path: Path) -> None:
    data = tmp_path / "node"
    pid, fd = _on_a_terminal(join_args(NOWHERE, data, "--device", "cpu", "--dashboard"))
    try:
        wait_until(lambda: (data / NODE_STATUS_FILE).exists(), 120, "the node under the dashboard to write its status")
        _read_until(fd, lambda out: b"echo2 node" in out, 30)
        os.write(fd, b"\x03")  # Ctrl-C, as the terminal's raw mode delivers it
        out = _read_until(fd, lambda out: b"versions installed" in out, 60)
    finally:
        code = _exit_code(pid, fd)
    assert b"echo-node: stopped" in out and b"0 versions installed, holds none" in out, out[-2000:]
    assert code == 0
    # The node the dashboard started is gone with it: a new one takes the data dir.
    again = subprocess.Popen(
        join_args(NOWHERE, data, "--device", "cpu"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        wait_until(
            lambda: again.poll() is not None or (data / NODE_LOCK_FILE).read_text().strip() == str(again.pid),
            60,
            "the new node to lock the data dir",
        )
        assert again.poll() is None, again.communicate()
    finally:
        again.kill()
        again.wait()


# -- against a real hub: another peer at its address, one node per data dir, SIGINT's summary -------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_node_names_the_wrong_peer_refuses_a_second_node_and_sums_up_on_sigint(tmp_path: Path) -> None:
    hub = start_hub(tmp_path / "hub", "--local-nodes", "0", "--steps", "0")
    try:
        transport, _, hub_id = hub.addr.partition("/p2p/")
        # 41.7: the /p2p/ part names another key than the one that answers there.
        wrong = run(
            "node.cli",
            "join",
            "--hub",
            f"{transport}/p2p/{HUB_ID}",
            "--data-dir",
            str(tmp_path / "n0"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--device",
            "cpu",
            timeout_s=120,
        )
        assert_one_line_mistake(
            wrong, f"another peer answered at {transport}", f"peer id {hub_id}", f"not {HUB_ID}", "check the /p2p/ part of --hub"
        )
        assert "unreachable" not in wrong.stdout
        # The same under the dashboard: it closes with the node and says what the node said.
        wrong_hub = f"{transport}/p2p/{HUB_ID}"
        pid, fd = _on_a_terminal(join_args(wrong_hub, tmp_path / "n0", "--device", "cpu", "--dashboard"))
        out = _read_until(fd, lambda out: b"check the /p2p/ part" in out, 120)
        assert _exit_code(pid, fd) == 2 and b"another peer answered at" in out, out[-2000:]
        # 41.9: one node per data dir; the second is told which process holds it.
        data = tmp_path / "n1"
        node = subprocess.Popen(
            join_args(hub.addr, data, "--device", "cpu"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        try:
            wait_until(
                lambda: (data / NODE_LOCK_FILE).exists() and (data / NODE_STATUS_FILE).exists(), 120, "the first node to start"
            )
            second = run(
                "node.cli",
                "join",
                "--hub",
                hub.addr,
                "--data-dir",
                str(data),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--device",
                "cpu",
            )
            assert_one_line_mistake(second, f"--data-dir {data}", f"another node (pid {node.pid})")
            # 41.9: SIGINT after the first snapshot is in: the summary counts it.
            wait_until(
                lambda: NodeView.model_validate_json((data / NODE_STATUS_FILE).read_text()).version_held >= 0,
                120,
                "the node to install the hub's first snapshot",
            )
            node.send_signal(signal.SIGINT)
            out, err = node.communicate(timeout=60)
        finally:
            if node.poll() is None:
                node.kill()
                node.wait()
        assert node.returncode == 0 and "Traceback" not in err, err[-2000:]
        assert "stopped (SIGINT)" in err
        # What the node wrote last and what it printed agree (the hub may have accepted probing work meanwhile).
        final = NodeView.model_validate_json((data / NODE_STATUS_FILE).read_text())
        assert "1 version installed, holds v0" in out and f"accepted {final.tallies.accepted}," in out, out[-2000:]
        assert f"${final.earnings_usd:.4f}" in out and f"{final.leases_done} leases" in out, out[-2000:]
    finally:
        hub.stop()
