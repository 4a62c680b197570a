"""Pay a volunteer can check (issue 67 item 6), against real `echo-hub` and `echo-node` processes and the hub's own
SQLite ledger: the node's summary says the seconds the hub paid (its ledger's) beside its own generating time, its
terminal names a lost hub in plain words and says installs at a reasonable pace; a price above the hub's ceiling is
refused before the engine is built; `echo-node join --help` says how the hub pays; a node whose every group arrives
late stays in standby, told why."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from hub.service.state import HubState
from node.keeper import INSTALL_LINE_S
from shared.crypto import Identity
from shared.layout import NODE_LOG_FILE, NODE_STATUS_FILE
from shared.messages import NodeView, Tallies, standby_text
from testbed.harness import query, start_hub, start_node, wait_until
from tests.test_first_contact import ROOT, run
from tests.test_state import join_request, reopen  # noqa: F401 -- fixtures

# What only an exception's name or repr says: none of it may reach a volunteer's terminal.
RAW_TRANSPORT = re.compile(r"Swarm\w*|StreamEOF|StreamReset|MuxedStream\w*|\w+Error\b|\w+Exception\b|Traceback")
# A small, quick run: a learner step every second or so on the tiny default model.
QUICK_RUN = ("--local-nodes", "0", "--steps", "0", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4")


def node_view(node_dir: Path) -> NodeView | None:
    try:
        return NodeView.model_validate_json((node_dir / NODE_STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def ledger(hub_dir: Path, peer: str) -> list[tuple[float, float]]:
    """The node's ledger rows, (seconds, usd), oldest first: what the hub booked for it and did not void."""
    return query(hub_dir, "SELECT seconds, usd FROM ledger WHERE node_id = ? AND voided = 0 ORDER BY id", (peer,))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_summarys_paid_seconds_are_the_ledgers_and_a_lost_hub_is_told_in_plain_words(tmp_path: Path) -> None:
    hub_dir, node_dir = tmp_path / "hub", tmp_path / "node"
    hub = start_hub(hub_dir, *QUICK_RUN)
    node = None
    try:
        started = time.monotonic()
        node = start_node(hub.addr, node_dir, price=0.35)
        view = wait_until(
            lambda: (v := node_view(node_dir)) is not None and v.paid_s > 0 and v.versions_installed >= 5 and v,
            180,
            "the node to be paid for work and to install five versions",
        )
        hub.kill()  # SIGKILL: the node finds its hub gone, as after a crash
        wait_until(lambda: " hub_lost " in node.output(), 60, "the node to say it lost the hub")
        wait_until(lambda: " unreachable " in node.output(), 60, "the node to say it cannot reach the hub")
        assert node.stop() == 0
        stopped = time.monotonic()
    finally:
        hub.kill()
        if node is not None:
            node.kill()
    printed = node.output()
    final = node_view(node_dir)
    assert final is not None and final.leases_done >= view.leases_done
    # The summary: the seconds the hub paid, to the tenth, beside this node's own generating time.
    paid = re.search(r"earnings   \$([\d.]+) for ([\d.]+) s paid at \$0\.35/h \(the hub's measure", printed)
    assert paid is not None and "busy       " in printed and "generating (this node's own clock)" in printed, printed[-3000:]
    assert float(paid[2]) == round(final.paid_s, 1) and float(paid[1]) == round(final.earnings_usd, 4)
    # The ledger's rows for this node: each reply's seconds added up. An answer cut off by the hub's death or the
    # node's stop may be booked without the node hearing of it: then it is the newest row, and the summary says so.
    rows = ledger(hub_dir, final.peer_id)
    booked = [seconds for seconds, _ in rows]
    assert final.unanswered in (0, 1), final
    heard = booked if final.unanswered == 0 or sum(booked) == pytest.approx(final.paid_s) else booked[:-1]
    assert sum(heard) == pytest.approx(final.paid_s, rel=1e-9, abs=1e-9), (booked, final.paid_s, final.unanswered)
    assert sum(usd for _, usd in rows[: len(heard)]) == pytest.approx(final.earnings_usd, rel=1e-9, abs=1e-12)
    assert ("  no reply   1 answer" in printed) == (final.unanswered == 1)
    # A lost hub in plain words, and what the node does next: never an exception's name or repr.
    lines = [line for line in printed.splitlines() if " hub_lost " in line or " unreachable " in line]
    assert any("the hub" in line and "joining it again" in line for line in lines), lines
    assert any("next try in" in line for line in lines), lines
    assert not RAW_TRANSPORT.search(printed), RAW_TRANSPORT.search(printed)
    # Installs at a reasonable pace: a terminal line and a node.log INFO line per INSTALL_LINE_S at most, and node.log
    # at INFO still ends with the last install and where it came from (one more line at most: that one, at the stop).
    windows = 1 + int((stopped - started) // INSTALL_LINE_S)  # the most lines the pace allows over the node's run
    said = [line for line in printed.splitlines() if " installed " in line]
    assert 1 <= len(said) <= windows < final.versions_installed, (said, final.versions_installed)
    logged = [line for line in (node_dir / NODE_LOG_FILE).read_text().splitlines() if "installed v" in line]
    assert 1 <= len(logged) <= windows + 1 and " INFO " in logged[-1], logged
    assert f"installed v{final.version_held} (" in logged[-1] and "last from hub over " in logged[-1], logged


def ceiling_hub(tmp_path: Path):
    """A hub whose price ceiling is $1/h."""
    config = tmp_path / "hub.toml"
    config.write_text("[scheduler]\nmax_price_per_hour = 1.0\n")
    return start_hub(tmp_path / "hub", *QUICK_RUN, "--config", str(config))


def join(hub_addr: str, node_dir: Path, *args: str) -> subprocess.CompletedProcess:
    node_dir.mkdir(parents=True, exist_ok=True)
    argv = ("node.cli", "join", "--hub", hub_addr, "--data-dir", str(node_dir), "--listen", "/ip4/127.0.0.1/tcp/0")
    return run(*argv, "--device", "cpu", "--backend", "hf", *args, timeout_s=120)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_price_above_the_hubs_ceiling_is_refused_before_the_engine_is_built(tmp_path: Path, default_model_dir: Path) -> None:
    """The node's model copy has garbage weights: building its engine fails. A price above the ceiling ends the node
    first, in one line naming the price and the ceiling; a price within it gets to the engine (and its failure)."""
    broken = tmp_path / "broken-model"
    shutil.copytree(default_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file" * 64)
    hub = ceiling_hub(tmp_path)
    try:
        above = join(hub.addr, tmp_path / "above", "--model", str(broken), "--price", "2.5")
        assert above.returncode == 2 and "Traceback" not in above.stderr, above.stderr[-3000:]
        (line,) = above.stderr.strip().splitlines()
        assert line == (
            "echo-node: --price 2.5 ($/h) is above this hub's ceiling $1/h, which it refuses at join: ask at most that"
        )
        within = join(hub.addr, tmp_path / "within", "--model", str(broken), "--price", "0.5")
        assert within.returncode != 0 and "safetensors" in within.stderr.lower(), within.stderr[-3000:]
        # A schedule is checked entry by entry; a node without --model is told as soon as the hub's files are in.
        schedule = join(hub.addr, tmp_path / "schedule", "--price-schedule", "07:00=0.5,19:00=3")
        assert schedule.returncode == 2 and schedule.stderr.strip().endswith(
            "--price-schedule's 19:00=3 ($/h) is above this hub's ceiling $1/h, which it refuses at join: ask at most that"
        ), schedule.stderr[-3000:]
        assert "the hub trains " in schedule.stdout and "Traceback" not in schedule.stderr
    finally:
        hub.stop()


def test_join_help_is_right_about_model_and_names_the_pay_rules() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "node.cli", "join", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert shown.returncode == 0
    text = " ".join(shown.stdout.split())
    assert "embedded default" not in text
    assert "--model MODEL a local copy of the model the hub trains" in text
    assert "None: the node fetches the hub's config and tokenizer, and the weights come as snapshots" in text
    for rule in (
        "cheapest per measured rollout/s (price / rate)",
        "at the price in force when it was issued",
        "in the share of its groups accepted",
        "a price above the hub's ceiling (its scheduler.max_price_per_hour) is refused before the engine is built",
        "unpaid time in standby; groups that arrive late",
        "relaying snapshots to the next node in a chain",
        "not activated again until its measured rate changes",
    ):
        assert rule in text, rule
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80


@pytest.mark.trio
async def test_a_node_whose_every_group_arrives_late_is_held_in_standby_until_it_is_measured_again(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """Membership, on a real store: two leases in a row whose every group came back late hold the node (too_slow) at
    the rate it was measured at (one alone may be the lease it held when released); an accepted group frees it; a
    re-join measures it again with a probe."""
    state: HubState = reopen(tmp_path, default_model_dir)
    node = Identity.generate().peer_id
    record = await state.membership.join(node, join_request(state), "10.0.0.1")
    state.membership.book_work(record, Tallies(accepted=1), {}, 2.9, True)  # its probe: in time
    assert not record.too_slow and record.joins_as() == "standby"
    state.membership.book_work(record, Tallies(late=4), {"late": 4}, 2.2, True)  # a lease: every group late
    assert not record.too_slow
    state.membership.book_work(record, Tallies(late=4), {"late": 4}, 2.03, True)  # and the next
    assert record.too_slow and record.late_at_rate == 2.03
    assert standby_text(0.35, record.rollouts_per_s, record.too_slow).startswith(
        "every group of your last two leases arrived late"
    )
    state.membership.book_work(record, Tallies(rejected=1, late=3), {"late": 3}, 1.5, True)  # not every group late
    assert not record.too_slow  # its rate moved from the one it was held at
    state.membership.book_work(record, Tallies(late=4), {"late": 4}, 1.05, True)
    assert record.too_slow
    again = await state.membership.join(node, join_request(state), "10.0.0.1")
    assert again is record and record.state == "probing" and not record.measured and not record.too_slow
    state.membership.book_work(record, Tallies(accepted=1), {}, 3.1, True)  # the probe of the re-join: in time
    assert record.late_at_rate is None and not record.too_slow
    await trio.to_thread.run_sync(state.store.close)
