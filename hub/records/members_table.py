"""The fleet's rows (nodes, prices, credit, bans): what Membership writes."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from hub.records.schema import CREDIT_HOUR_S, IDLE_NODE_SQL, PRICES_KEPT_PER_NODE, Credit, LeaderRow, NewEvent, NodeRow
from hub.records.table import Table


class MembersTable(Table):
    """The fleet's rows (nodes, prices, credit, bans): what Membership writes."""

    def upsert_node(
        self,
        peer_id: str,
        price_per_hour: float,
        hardware: str,
        link_bps: float | None,
        backend: str,
        state: str = "probing",
        event: NewEvent | None = None,
        name: str | None = None,
        price_changed_at: float | None = None,
    ) -> bool:
        """Insert a node on first contact or refresh what it declares (its display name too: None shows its short
        peer id); tallies, audits and ban survive. `price_changed_at`: the join changes its price (a re-join at
        another one), at that time; None keeps the time of its last change.

        False (and nothing written) for a banned node: a ban is checked in the same transaction, so a
        join racing a ban can never undo it."""
        now = time.time()
        with self._write():
            cur = self.db.execute(
                "INSERT INTO nodes (peer_id, price_per_hour, hardware, link_bps, backend, first_seen, last_seen, state, name,"
                " price_changed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(peer_id) DO UPDATE SET price_per_hour = excluded.price_per_hour,"
                " hardware = excluded.hardware, link_bps = excluded.link_bps, backend = excluded.backend,"
                " last_seen = excluded.last_seen, state = excluded.state, name = excluded.name,"
                " price_changed_at = COALESCE(excluded.price_changed_at, nodes.price_changed_at) WHERE nodes.state != 'banned'",
                (peer_id, price_per_hour, hardware, link_bps, backend, now, now, state, name, price_changed_at),
            )
            if cur.rowcount != 1:
                return False
            self._price_row(peer_id, price_per_hour, now)
            self._events([event] if event else [])
            return True

    def set_node_price(self, peer_id: str, price_per_hour: float, at: float, event: NewEvent | None = None) -> bool:
        """A joined node's re-declared price at `at`, kept in its price history and as the time of its last change (the
        one-per-interval rule's clock, across restarts); False (nothing written) when banned."""
        with self._write():
            cur = self.db.execute(
                "UPDATE nodes SET price_per_hour = ?, price_changed_at = ? WHERE peer_id = ? AND state != 'banned'",
                (price_per_hour, at, peer_id),
            )
            if cur.rowcount != 1:
                return False
            self._price_row(peer_id, price_per_hour, at)
            self._events([event] if event else [])
            return True

    def _price_row(self, peer_id: str, price_per_hour: float, at: float) -> None:
        """A price history row, unless the node's latest row already says this price (a rejoin at the same one);
        the node's rows past its newest PRICES_KEPT_PER_NODE go (a node re-declares or rejoins as often as it likes)."""
        self.db.execute(
            "INSERT INTO prices (node_id, at, price_per_hour) SELECT ?, ?, ? WHERE ? IS NOT"
            " (SELECT price_per_hour FROM prices WHERE node_id = ? ORDER BY at DESC, rowid DESC LIMIT 1)",
            (peer_id, at, price_per_hour, price_per_hour, peer_id),
        )
        self.db.execute(
            "DELETE FROM prices WHERE node_id = ? AND rowid NOT IN (SELECT rowid FROM prices WHERE node_id = ?"
            " ORDER BY at DESC, rowid DESC LIMIT ?)",
            (peer_id, peer_id, PRICES_KEPT_PER_NODE),
        )

    def price_history(self, limit_per_node: int, seen_since: float = -math.inf) -> dict[str, list[tuple[float, float]]]:
        """(at, $/h) of each node's latest `limit_per_node` prices, oldest first: of the nodes `nodes(seen_since)` lists."""
        rows = self._rows(
            "SELECT node_id, at, price_per_hour FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY node_id"
            " ORDER BY at DESC, rowid DESC) AS newest FROM prices WHERE node_id IN (SELECT peer_id FROM nodes"
            " WHERE last_seen >= ?)) WHERE newest <= ? ORDER BY node_id, at, rowid",
            (seen_since, limit_per_node),
        )
        history: dict[str, list[tuple[float, float]]] = {}
        for row in rows:
            history.setdefault(row["node_id"], []).append((row["at"], row["price_per_hour"]))
        return history

    def count_refusal(self, peer_id: str) -> None:
        """One more request of this node refused at the protocol level (bad frame, expired lease...)."""
        with self._write():
            self.db.execute("UPDATE nodes SET refused = refused + 1 WHERE peer_id = ?", (peer_id,))

    def record_audit_pass(
        self, peer_id: str, vouched_at: float, release_ids: Sequence[int] = (), now: float | None = None
    ) -> bool:
        """One more audit of this node's work passed; its pay up to `vouched_at` (the audited submission's
        time; 0: none newly vouched for) is vouched for, and its held rows `release_ids` may be trained on. Both survive a hub restart:
        probation, quota and what a later ban voids. False (nothing written) if the node is banned. The pass
        counts in the credit hour of `now` (the caller's clock, as submissions' do; default the wall clock)."""
        with self._write():
            cur = self.db.execute(
                "UPDATE nodes SET audits_passed = audits_passed + 1, vouched_at = MAX(COALESCE(vouched_at, 0), ?)"
                " WHERE peer_id = ? AND state != 'banned'",
                (vouched_at, peer_id),
            )
            if cur.rowcount != 1:
                return False
            self.db.conn.executemany("UPDATE trajectories SET held = 0 WHERE id = ?", [(i,) for i in release_ids])
            self._credit(peer_id, time.time() if now is None else now, Credit(accepted=0, tokens=0, gpu_s=0.0, audits_passed=1))
            return True

    def leaders(self, now: float, limit: int) -> list[LeaderRow]:
        """The leaderboard: the `limit` volunteers with the most accepted groups over the whole run and the `limit`
        with the most over the last day (its 24 hour buckets), banned ones left out; indexed, never a scan of the work."""
        rows = self._rows(
            "WITH day AS (SELECT node_id, SUM(accepted) AS accepted, SUM(tokens) AS tokens, SUM(gpu_s) AS gpu_s,"
            "  SUM(audits_passed) AS audits_passed FROM credit_hours WHERE hour > ? GROUP BY node_id),"
            " top AS (SELECT node_id FROM (SELECT node_id FROM day WHERE node_id NOT IN"
            "   (SELECT peer_id FROM nodes WHERE state = 'banned') ORDER BY accepted DESC LIMIT ?)"
            "  UNION SELECT peer_id FROM (SELECT peer_id FROM nodes WHERE state != 'banned' ORDER BY accepted DESC LIMIT ?))"
            " SELECT n.peer_id, n.name, n.accepted, n.tokens, n.gpu_s, n.audits_passed, COALESCE(d.accepted, 0) AS d_accepted,"
            "  COALESCE(d.tokens, 0) AS d_tokens, COALESCE(d.gpu_s, 0) AS d_gpu_s, COALESCE(d.audits_passed, 0) AS d_audits"
            " FROM nodes n JOIN top t ON t.node_id = n.peer_id LEFT JOIN day d ON d.node_id = n.peer_id"
            " WHERE n.state != 'banned' AND (n.accepted > 0 OR n.audits_passed > 0) ORDER BY n.accepted DESC",
            (int(now // CREDIT_HOUR_S) - 24, limit, limit),
        )
        return [
            LeaderRow(
                r["peer_id"],
                r["name"],
                Credit(r["accepted"], r["tokens"], r["gpu_s"], r["audits_passed"]),
                Credit(r["d_accepted"], r["d_tokens"], r["d_gpu_s"], r["d_audits"]),
            )
            for r in rows
        ]

    def set_node_state(self, peer_id: str, state: str, banned_reason: str | None = None, event: NewEvent | None = None) -> bool:
        """Move a node to `state`; False (and nothing written) when it is banned: a ban is for good."""
        with self._write():
            cur = self.db.execute(
                "UPDATE nodes SET state = ?, banned_reason = COALESCE(?, banned_reason) WHERE peer_id = ? AND state != 'banned'",
                (state, banned_reason, peer_id),
            )
            if cur.rowcount != 1:
                if self.db.execute("SELECT 1 FROM nodes WHERE peer_id = ?", (peer_id,)).fetchone() is None:
                    raise KeyError(f"unknown node {peer_id}")
                return False
            self._events([event] if event else [])
            return True

    def remembered(self, peer_id: str, prices_kept: int) -> tuple[NodeRow, tuple[tuple[float, float], ...]] | None:
        """A node's row and its latest `prices_kept` prices, (at, $/h) oldest first; None for a node never seen."""
        row = self.node(peer_id)
        rows = self._rows(
            "SELECT at, price_per_hour FROM prices WHERE node_id = ? ORDER BY at DESC, rowid DESC LIMIT ?", (peer_id, prices_kept)
        )
        return None if row is None else (row, tuple((r["at"], r["price_per_hour"]) for r in reversed(rows)))

    def node(self, peer_id: str) -> NodeRow | None:
        rows = self._rows("SELECT * FROM nodes WHERE peer_id = ?", (peer_id,))
        return NodeRow.from_sql(rows[0]) if rows else None

    def nodes(self, seen_since: float = -math.inf) -> list[NodeRow]:
        """The nodes last seen at `seen_since` or later (epoch seconds; default all), first seen first."""
        return [
            NodeRow.from_sql(r) for r in self._rows("SELECT * FROM nodes WHERE last_seen >= ? ORDER BY first_seen", (seen_since,))
        ]

    def seen_before(self, at: float) -> tuple[int, float]:
        """How many nodes were last seen before `at`, and their $/h x online seconds (their share of the all-on cost): the
        identities retention forgot (`forget_idle`) included."""
        rows = self._rows(
            "SELECT COUNT(peer_id) + f.nodes AS n, COALESCE(SUM(price_per_hour * online_s), 0) + f.usd_s AS s"
            " FROM forgotten_nodes f LEFT JOIN nodes ON last_seen < ?",
            (at,),
        )
        return int(rows[0]["n"]), float(rows[0]["s"])

    def forget_idle(self, before: float) -> int:
        """Inside the caller's transaction (Store.retain): delete the rows of the identities last seen before `before` that
        left nothing to remember (IDLE_NODE_SQL), hold no lease but expired ones and no ledger row, with their prices and
        expired leases; their count and $/h x online seconds go to the `forgotten_nodes` roll-up. How many went."""
        # By the partial index of such rows (SQLite refuses the query if it cannot use it): a pass reads only them.
        idle = self.db.execute(
            f"SELECT peer_id, price_per_hour * online_s FROM nodes INDEXED BY nodes_idle WHERE {IDLE_NODE_SQL} AND last_seen < ?"
            " AND NOT EXISTS (SELECT 1 FROM leases WHERE node_id = nodes.peer_id AND state != 'expired')"
            " AND NOT EXISTS (SELECT 1 FROM ledger WHERE node_id = nodes.peer_id)",
            (before,),
        ).fetchall()
        peers = [(peer,) for peer, _ in idle]
        for table in ("leases", "prices"):
            self.db.conn.executemany(f"DELETE FROM {table} WHERE node_id = ?", peers)
        self.db.conn.executemany("DELETE FROM nodes WHERE peer_id = ?", peers)
        self.db.execute(
            "UPDATE forgotten_nodes SET nodes = nodes + ?, usd_s = usd_s + ?", (len(idle), math.fsum(usd_s for _, usd_s in idle))
        )
        return len(idle)

    def flush_liveness(self, rows: Sequence[tuple[str, float, float, float, bool]], session_id: int, alive_at: float) -> None:
        """(peer, last_seen, online_s, rollouts_per_s, measured) per node that changed, and this session's clock."""
        with self._write():
            self.db.conn.executemany(
                "UPDATE nodes SET last_seen = ?, online_s = ?, rollouts_per_s = ?, measured = ? WHERE peer_id = ?",
                [(last_seen, online_s, rate, int(measured), peer) for peer, last_seen, online_s, rate, measured in rows],
            )
            self.db.execute("UPDATE sessions SET alive_at = ? WHERE id = ?", (alive_at, session_id))

    def penalize_node(
        self,
        node_id: str,
        discard_ids: Sequence[int],
        since_ts: float,
        reason: str,
        event: NewEvent | None = None,
        discard_reason: str = "banned: audit failed",
    ) -> tuple[int, float]:
        """In one transaction: ban the node, discard its dropped pending rows, void its pay booked after
        `since_ts` (epoch seconds), and log the event.

        Returns (ledger rows voided, what the node is still paid); ValueError (and no change) if a row
        is not pending.
        """
        with self._write():
            cur = self.db.execute("UPDATE nodes SET state = 'banned', banned_reason = ? WHERE peer_id = ?", (reason, node_id))
            if cur.rowcount != 1:
                raise KeyError(f"unknown node {node_id}")
            self._discard(discard_ids, discard_reason)
            # Its work still held for audit is discarded with it.
            self.db.execute(
                "UPDATE trajectories SET discard_reason = ? WHERE node_id = ? AND held = 1 AND consumed_step IS NULL"
                " AND discard_reason IS NULL",
                (discard_reason, node_id),
            )
            voided = self.db.execute(
                "UPDATE ledger SET voided = 1 WHERE node_id = ? AND created_at > ? AND voided = 0", (node_id, since_ts)
            ).rowcount
            paid = self.db.execute(
                "SELECT COALESCE(SUM(usd), 0) FROM ledger WHERE node_id = ? AND voided = 0", (node_id,)
            ).fetchone()[0]
            self._events([event] if event else [])
        return voided, float(paid)
