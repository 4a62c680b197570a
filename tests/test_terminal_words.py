"""No raw transport text and no cut figures where volunteers and operators look (issue 67 item 7): a failed dial or a
stream cut short, on real libp2p hosts, reads as a plain sentence (shared/failures.py); `echo-hub status` on a data
dir whose hub is still starting says so; its nodes table keeps every figure whole at 80 columns; the run summary
names nodes by their --name."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
import trio
from rich.console import Console

from hub.cli.status import render
from hub.cli.summary import print_summary
from shared.crypto import Identity
from shared.failures import CLOSED, RECENTLY, REFUSED, TIMED_OUT, plain_failure
from shared.layout import HUB_LOCK_FILE, HUB_STATUS_FILE
from shared.lock import lock_data_dir
from shared.messages import NodeStatus, Tallies
from shared.net import connect, open_stream, running_host, set_handler
from shared.wire import read_exact
from testbed.harness import free_port
from tests.test_first_contact import run
from tests.test_tui import NODE_IDS, hub_status

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
TEST_PROTOCOL = "/echo2-test/cut/1"


@pytest.mark.trio
async def test_real_transport_failures_read_as_plain_sentences() -> None:
    nobody = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{Identity.generate().peer_id}"
    async with running_host(Identity.generate(), [LOOPBACK]) as (host, _):
        with pytest.raises(Exception) as refused:  # noqa: PT011 - py-libp2p's own: SwarmDialAllFailedError
            await connect(host, nobody)
        assert plain_failure(refused.value) == REFUSED
        # The next dial of that peer meets py-libp2p's negative cache, which names no cause of its own.
        with pytest.raises(Exception) as again:  # noqa: PT011
            await connect(host, nobody)
        assert plain_failure(again.value) in (RECENTLY, REFUSED)

        async with running_host(Identity.generate(), [LOOPBACK]) as (peer, peer_addrs):

            async def hang_up(stream) -> None:
                await stream.close()  # answers nothing: the reader's stream ends after 0 of its bytes

            set_handler(peer, TEST_PROTOCOL, hang_up, None)
            peer_id = await connect(host, f"{peer_addrs[0]}/p2p/{peer.get_id().to_base58()}")
            stream = await open_stream(host, peer_id, TEST_PROTOCOL)
            with pytest.raises(Exception) as cut:  # noqa: PT011 - shared.wire.StreamEOF
                await read_exact(stream, 5)
            assert type(cut.value).__name__ == "StreamEOF" and plain_failure(cut.value) == CLOSED
    assert plain_failure(trio.TooSlowError()) == TIMED_OUT
    # Wrapped as trio and py-libp2p wrap them: a timeout anywhere explains the rest.
    assert plain_failure(ExceptionGroup("g", [OSError("x"), trio.TooSlowError()])) == TIMED_OUT
    for text in (REFUSED, CLOSED, RECENTLY, TIMED_OUT):
        assert "Error" not in text and "Exception" not in text and "Swarm" not in text


def test_status_says_a_hub_that_is_still_starting_is_starting(tmp_path: Path) -> None:
    data = tmp_path / "data"
    lock = lock_data_dir(data, HUB_LOCK_FILE, "hub")  # a hub building its model holds its data dir, writes no status
    try:
        starting = run("hub.cli", "status", "--data-dir", str(data))
        assert starting.returncode == 1 and "Traceback" not in starting.stderr, starting.stderr
        (line,) = starting.stderr.strip().splitlines()
        assert line.startswith(f"echo-hub status: the hub in {data} (pid {os.getpid()}) is starting:"), line
        assert "give the --data-dir of a hub" not in line
        # A status an earlier start wrote (older than this start's lock) is not this hub's: still starting.
        status = data / HUB_STATUS_FILE
        status.write_text(hub_status().model_dump_json())
        earlier = (data / HUB_LOCK_FILE).stat().st_mtime - 60
        os.utime(status, (earlier, earlier))
        assert "is starting:" in run("hub.cli", "status", "--data-dir", str(data)).stderr
        # Once this start writes its status, that is what status shows.
        now = time.time()
        os.utime(status, (now, now))
        shown = run("hub.cli", "status", "--data-dir", str(data))
        assert shown.returncode == 0 and "is starting" not in shown.stderr and "nodes" in shown.stdout, shown.stderr
    finally:
        lock.close()
    # No hub there at all: the mistake it always was.
    missing = run("hub.cli", "status", "--data-dir", str(tmp_path / "none"))
    assert missing.returncode == 2 and "give the --data-dir of a hub" in missing.stderr


def wide_status():
    """Nodes with a 32-character name and the figures of a long run: six-digit accepted groups, thousands late, a
    five-decimal cost, a hole-punched link."""
    status = hub_status()
    nodes = tuple(
        n.model_copy(
            update={
                "name": f"volunteer-with-a-long-name-{i:05d}",
                "tallies": Tallies(accepted=123456, rejected=123, late=1234, refused=12),
                "cost_usd": 12.34567,
                "rollouts_per_s": 123.45,
                "version_held": 1234,
                "price_per_hour": 10.0,
                "reachability": "nated",
                "link": "holepunch",
            }
        )
        for i, n in enumerate(status.nodes)
    )
    return status.model_copy(update={"nodes": nodes})


def test_the_nodes_table_keeps_every_figure_whole_at_80_columns() -> None:
    status = wide_status()
    out = io.StringIO()
    render(status, Console(file=out, width=80))
    printed = out.getvalue()
    assert max(len(line) for line in printed.splitlines()) <= 80
    for n in status.nodes:
        row = next(line for line in printed.splitlines() if " 12.34567 " in line and n.state in line)
        for figure in ("10.00", "123.45", "1234", "123456", "123", "12", "12.34567", "nat/punch"):
            assert f" {figure} " in f" {row} ", (figure, row)
    # The peer column folds the name and id over lines: the id, which tells nodes apart, is whole.
    assert all(n.peer_id[-8:] in printed for n in status.nodes)


def test_a_node_held_back_as_too_slow_says_so_in_the_nodes_table() -> None:
    status = wide_status()
    held = status.model_copy(update={"nodes": (status.nodes[0].model_copy(update={"state": "standby", "too_slow": True}),)})
    out = io.StringIO()
    render(held, Console(file=out, width=160))
    assert "standby (too slow)" in out.getvalue()


def test_the_run_summary_names_nodes_by_their_name(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line per row
    status = hub_status()
    named = status.nodes[0].model_copy(update={"name": "alice's-4090"})
    status = status.model_copy(update={"nodes": (named, *status.nodes[1:])})
    (tmp_path / HUB_STATUS_FILE).write_text(status.model_dump_json())
    print_summary(tmp_path)
    out = " ".join(capsys.readouterr().out.split())
    assert f"alice's-4090 ({NODE_IDS[0][-8:]}): active, 640" in out, out
    assert f"{NODE_IDS[2][-8:]}: standby, 128" in out, out


def test_a_node_status_label_is_not_what_the_summary_cuts() -> None:
    """The summary names a node in full (its name can be 32 characters), where a table cuts it to LABEL_NAME_CHARS."""
    node = NodeStatus(
        peer_id=NODE_IDS[0],
        state="active",
        price_per_hour=0.35,
        rollouts_per_s=1.0,
        version_held=1,
        tallies=Tallies(accepted=3),
        cost_usd=0.0,
        name="a-very-long-volunteer-name-32chr",
    )
    from hub.cli.summary import _node_text

    assert _node_text(node) == f"a-very-long-volunteer-name-32chr ({NODE_IDS[0][-8:]}): active, 3"
    assert node.label().startswith("a-very-long-vol…")
