"""Submitted groups (trajectories, payloads), their rejections, discards and pay (the ledger): what Intake writes."""

from __future__ import annotations

import time
from collections.abc import Sequence

import blake3

from hub.records.buffer import REASON_STALE, REASON_ZERO_VARIANCE
from hub.records.schema import VERDICTS, Credit, NewEvent, NodeBanned, SettledGroups, TrainedWork, TrajectoryRow, Verdict
from hub.records.table import Table
from shared.rollout import Group


class GroupsTable(Table):
    """Submitted groups (trajectories, payloads), their rejections, discards and pay (the ledger): what Intake writes."""

    def record_trajectory(
        self,
        group: Group,
        lease_id: str | None,
        node_id: str,
        verdict: Verdict,
        reason: str | None = None,
        signed_bytes_hash: str | None = None,
    ) -> int:
        """Durably record a received group with the hub's verdict; returns its row id.

        Returning means committed: only then may the submission be acknowledged.
        """
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
        reward_mean = sum(group.rewards) / len(group.rewards) if group.rewards else 0.0
        group_json = group.model_dump_json()
        with self._write():
            cur = self.db.execute(
                "INSERT INTO trajectories (lease_id, node_id, prompt_id, version, group_hash, reward_mean,"
                " verdict, reason, received_at, signed_bytes_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    lease_id,
                    node_id,
                    group.prompt_id,
                    group.version,
                    blake3.blake3(group_json.encode()).hexdigest(),
                    reward_mean,
                    verdict,
                    reason,
                    time.time(),
                    signed_bytes_hash,
                ),
            )
            self._keep_payload(int(cur.lastrowid), group_json if verdict == "accepted" else None)
            if node_id:
                # `verdict` was checked against VERDICTS above: it names a column.
                self.db.execute(f"UPDATE nodes SET {verdict} = {verdict} + 1 WHERE peer_id = ?", (node_id,))
            return int(cur.lastrowid)

    def record_submission(
        self,
        lease_id: str,
        node_id: str,
        verdicts: Sequence,
        usd: float,
        seconds: float,
        signed_bytes_hash: str,
        tokens: int = 0,
        now: float | None = None,
        rollouts_per_s: float | None = None,
        events: Sequence[NewEvent] = (),
        hold: bool = False,
        reply_json: str | None = None,
    ) -> list[int]:
        """In one transaction: close the lease (keeping the answer's hash and `reply_json`, the reply it gets, for the
        same answer sent again), record every group with its verdict, count them against the node, book the payment and
        the leaderboard's credit (`seconds` billed, `tokens` of the accepted completions), store the node's new measured
        throughput, and the events.

        `verdicts` are hub.trust.submissions.GroupVerdict. Returns the row ids in verdict order. `hold`: the
        accepted rows wait for an audit (`record_audit_pass` releases them). A banned node raises
        NodeBanned, and a lease that is not open for this node (a replay racing the first answer)
        ValueError; either changes nothing.
        """
        now = time.time() if now is None else now
        ids: list[int] = []
        with self._write():
            banned = self.db.execute("SELECT 1 FROM nodes WHERE peer_id = ? AND state = 'banned'", (node_id,)).fetchone()
            if banned is not None:
                raise NodeBanned(node_id)
            cur = self.db.execute(
                "UPDATE leases SET state = 'answered', answered_at = ?, answer_hash = ?, reply_json = ?"
                " WHERE id = ? AND node_id = ? AND state = 'open'",
                (now, signed_bytes_hash, reply_json, lease_id, node_id),
            )
            if cur.rowcount != 1:
                raise ValueError(f"lease {lease_id} is not open for {node_id}")
            for v in verdicts:
                if v.accepted:
                    group_json, version = v.group.model_dump_json(), v.group.version
                    group_hash = blake3.blake3(group_json.encode()).hexdigest()
                    reward_mean = sum(v.group.rewards) / len(v.group.rewards)
                else:
                    # Refused work: its hash, not its payload (a peer must not fill our disk with it).
                    group_json, group_hash = None, blake3.blake3(v.submitted.model_dump_json().encode()).hexdigest()
                    version = v.submitted.completions[0].version if v.submitted.completions else -1
                    reward_mean = 0.0
                cur = self.db.execute(
                    "INSERT INTO trajectories (lease_id, node_id, prompt_id, version, group_hash, reward_mean,"
                    " verdict, reason, received_at, signed_bytes_hash, held) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        lease_id,
                        node_id,
                        v.prompt_id[:200],
                        version,
                        group_hash,
                        reward_mean,
                        v.verdict,
                        (v.reason or None) and v.reason[:500],
                        now,
                        signed_bytes_hash,
                        int(hold and v.accepted),
                    ),
                )
                ids.append(int(cur.lastrowid))
                self._keep_payload(ids[-1], group_json)
            counts = [sum(v.verdict == name for v in verdicts) for name in VERDICTS]
            sets = ", ".join(f"{name} = {name} + ?" for name in VERDICTS)
            self.db.execute(f"UPDATE nodes SET {sets} WHERE peer_id = ?", (*counts, node_id))
            self._credit(node_id, now, Credit(counts[VERDICTS.index("accepted")], tokens, seconds, 0))
            if rollouts_per_s is not None:
                self.db.execute("UPDATE nodes SET rollouts_per_s = ?, measured = 1 WHERE peer_id = ?", (rollouts_per_s, node_id))
            if usd > 0:
                self.db.execute(
                    "INSERT INTO ledger (node_id, lease_id, step, usd, seconds, created_at) VALUES (?, ?, NULL, ?, ?, ?)",
                    (node_id, lease_id, usd, seconds, now),
                )
            self._events(events)
        return ids

    def recent_usable_groups(self, limit: int) -> SettledGroups:
        """Trained, settled, dropped as stale and skipped for equal rewards, among the newest `limit` accepted groups
        that were trained on or discarded. Both this and `recent_discards` walk back from the newest row and stop at `limit` (through the
        verdict index SQLite would sort every accepted group ever: a status build would cost the whole history)."""
        row = self._rows(
            "SELECT COALESCE(SUM(consumed_step IS NOT NULL), 0) AS trained, COUNT(*) AS settled,"
            " COALESCE(SUM(discard_reason = ?), 0) AS stale, COALESCE(SUM(discard_reason = ?), 0) AS zero FROM ("
            " SELECT consumed_step, discard_reason FROM trajectories NOT INDEXED WHERE verdict = 'accepted'"
            " AND (consumed_step IS NOT NULL OR discard_reason IS NOT NULL) ORDER BY id DESC LIMIT ?)",
            (REASON_STALE, REASON_ZERO_VARIANCE, limit),
        )[0]
        return SettledGroups(int(row["trained"]), int(row["settled"]), int(row["stale"]), int(row["zero"]))

    def trajectory_counts(self) -> dict[Verdict, int]:
        """Groups ever received, by verdict (every verdict present, zero if none)."""
        rows = self._rows("SELECT name, n FROM counts WHERE name != 'stale'")
        return {name: 0 for name in VERDICTS} | {r["name"]: int(r["n"]) for r in rows}

    def recent_discards(self, limit: int) -> dict[str, int]:
        """How the newest `limit` settled accepted groups were settled: reason -> count ("trained" for trained on)."""
        rows = self._rows(
            "SELECT COALESCE(discard_reason, 'trained') AS how, COUNT(*) AS n FROM ("
            " SELECT discard_reason FROM trajectories NOT INDEXED WHERE verdict = 'accepted'"
            " AND (consumed_step IS NOT NULL OR discard_reason IS NOT NULL) ORDER BY id DESC LIMIT ?) GROUP BY how",
            (limit,),
        )
        return {r["how"]: int(r["n"]) for r in rows}

    def recent_rejections(self, limit: int) -> dict[str, int]:
        """Why the newest `limit` rejected groups were rejected: reason -> count."""
        rows = self._rows(
            "SELECT COALESCE(reason, '?') AS why, COUNT(*) AS n FROM ("
            " SELECT reason FROM trajectories WHERE verdict = 'rejected' ORDER BY id DESC LIMIT ?) GROUP BY why",
            (limit,),
        )
        return {r["why"]: int(r["n"]) for r in rows}

    def dropped_stale_count(self) -> int:
        """Accepted groups ever dropped as too stale to train on."""
        return int(self._rows("SELECT n FROM counts WHERE name = 'stale'")[0]["n"])

    def discard_trajectories(self, ids: Sequence[int], reason: str) -> None:
        """Mark accepted, untrained rows as never to be trained on (e.g. refused by the buffer)."""
        with self._write():
            self._discard(ids, reason)

    def discard_if_pending(self, ids: Sequence[int], reason: str) -> None:
        """Discard those of `ids` still pending (a ban may have discarded some already)."""
        with self._write():
            self.db.conn.executemany(
                "UPDATE trajectories SET discard_reason = ? WHERE id = ? AND verdict = 'accepted'"
                " AND consumed_step IS NULL AND discard_reason IS NULL",
                [(reason, i) for i in ids],
            )

    def discard_and_void(self, ids: Sequence[int], reason: str, node_id: str, lease_id: str) -> float:
        """Work that could not be audited: its pending rows discarded and its lease's pay voided, in one
        transaction. What the node is still paid."""
        with self._write():
            self.db.conn.executemany(
                "UPDATE trajectories SET discard_reason = ? WHERE id = ? AND verdict = 'accepted'"
                " AND consumed_step IS NULL AND discard_reason IS NULL",
                [(reason, i) for i in ids],
            )
            self.db.execute("UPDATE ledger SET voided = 1 WHERE node_id = ? AND lease_id = ?", (node_id, lease_id))
            return float(
                self.db.execute(
                    "SELECT COALESCE(SUM(usd), 0) FROM ledger WHERE node_id = ? AND voided = 0", (node_id,)
                ).fetchone()[0]
            )

    def discard_held(self, reason: str) -> int:
        """Discard every row still held for an audit (at start: their audits died with the last hub)."""
        with self._write():
            return self.db.execute(
                "UPDATE trajectories SET discard_reason = ? WHERE verdict = 'accepted' AND consumed_step IS NULL"
                " AND discard_reason IS NULL AND held = 1",
                (reason,),
            ).rowcount

    def unconsumed_groups(self) -> list[tuple[int, Group]]:
        """Accepted rows neither trained on nor discarded, oldest first: the buffer after a restart."""
        rows = self._rows(
            # A pending row always has its payload (retention takes only settled ones'): a missing one raises here.
            "SELECT t.id, p.group_json FROM trajectories t LEFT JOIN payloads p ON p.id = t.id WHERE verdict = 'accepted'"
            " AND consumed_step IS NULL AND discard_reason IS NULL AND held = 0 ORDER BY t.id"
        )
        return [(r["id"], Group.model_validate_json(r["group_json"])) for r in rows]

    def trained_of(self, node_id: str) -> TrainedWork:
        """The node's groups the learner trained on: what a ban of it reports, since they stay learned."""
        groups, first, last = self.db.execute(
            "SELECT COUNT(*), MIN(consumed_step), MAX(consumed_step) FROM trajectories WHERE node_id = ? AND consumed_step IS NOT NULL",
            (node_id,),
        ).fetchone()
        return TrainedWork(int(groups), first, last)

    def trajectories(self) -> list[TrajectoryRow]:
        cols = ", ".join(f for f in TrajectoryRow.__dataclass_fields__)
        return [TrajectoryRow(**r) for r in self._rows(f"SELECT {cols} FROM trajectories ORDER BY id")]

    def ledger_total_usd(self, node_id: str | None = None) -> float:
        """Money booked and not voided, for one node or all."""
        if node_id is None:
            rows = self._rows("SELECT COALESCE(SUM(usd), 0) AS t FROM ledger WHERE voided = 0")
        else:
            rows = self._rows("SELECT COALESCE(SUM(usd), 0) AS t FROM ledger WHERE voided = 0 AND node_id = ?", (node_id,))
        return float(rows[0]["t"])

    def ledger_by_node_usd(self) -> dict[str, float]:
        """Money booked and not voided, per node."""
        rows = self._rows("SELECT node_id, SUM(usd) AS t FROM ledger WHERE voided = 0 GROUP BY node_id")
        return {r["node_id"]: float(r["t"]) for r in rows}
