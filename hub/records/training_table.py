"""The learner's rows: steps, checkpoints and evaluations."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from hub.records.buffer import REASON_STALE
from hub.records.schema import _STEP_COLUMNS, CheckpointRow, StepRecord
from hub.records.table import Table
from shared.messages import EvalPoint


class TrainingTable(Table):
    """The learner's rows: steps, checkpoints and evaluations."""

    def commit_step(self, record: StepRecord, consumed_ids: Sequence[int], dropped_stale_ids: Sequence[int] = ()) -> None:
        """In one transaction: the step row, its consumed and its stale-dropped trajectories."""
        now = time.time()
        with self._write():
            self.db.execute(
                f"INSERT INTO steps ({_STEP_COLUMNS}, metrics_json) VALUES ({', '.join('?' * 14)})",
                (
                    record.step,
                    record.version,
                    record.reward_mean,
                    record.reward_std,
                    record.staleness_mean,
                    record.staleness_max,
                    record.dropped_stale,
                    record.t_train_s,
                    record.t_idle_s,
                    record.bubble,
                    record.tokens,
                    record.clip_frac,
                    now,
                    json.dumps(_metrics(record)),
                ),
            )
            for row_id in consumed_ids:
                cur = self.db.execute(
                    "UPDATE trajectories SET consumed_step = ? WHERE id = ? AND verdict = 'accepted'"
                    " AND consumed_step IS NULL AND discard_reason IS NULL",
                    (record.step, row_id),
                )
                if cur.rowcount != 1:
                    raise ValueError(f"trajectory {row_id} is not an accepted, pending row")
            self._discard(dropped_stale_ids, REASON_STALE)

    def steps(self) -> list[StepRecord]:
        return self._step_records("SELECT * FROM steps ORDER BY step")

    def _step_records(self, sql: str, params: Sequence = ()) -> list[StepRecord]:
        out = []
        for r in self._rows(sql, params):
            extra = json.loads(r.pop("metrics_json"))
            r.pop("created_at")
            budget = extra.pop("staleness_budget", None)
            out.append(StepRecord(**r, extra=extra, staleness_budget=None if budget is None else int(budget)))
        return out

    def latest_step(self) -> int | None:
        return self._rows("SELECT MAX(step) AS s FROM steps")[0]["s"]

    def latest_step_record(self) -> StepRecord | None:
        """The newest committed step, None before the first."""
        newest = self._step_records("SELECT * FROM steps ORDER BY step DESC LIMIT 1")
        return newest[0] if newest else None

    def recent_steps(self, limit: int) -> list[StepRecord]:
        """The newest `limit` learner steps, oldest first."""
        return self._step_records("SELECT * FROM (SELECT * FROM steps ORDER BY step DESC LIMIT ?) ORDER BY step", (limit,))

    def add_checkpoint(self, step: int, path: str, version: int) -> None:
        with self._write():
            self.db.execute(
                "INSERT OR REPLACE INTO checkpoints (step, path, version, created_at) VALUES (?, ?, ?, ?)",
                (step, path, version, time.time()),
            )

    def latest_checkpoint(self) -> CheckpointRow | None:
        rows = self._rows("SELECT * FROM checkpoints ORDER BY step DESC LIMIT 1")
        return CheckpointRow(**rows[0]) if rows else None

    def add_eval(self, row: EvalPoint) -> None:
        with self._write():
            self.db.execute(
                "INSERT OR REPLACE INTO evals (step, reward, pass_at_1, pass_at_k, k, prompts, seconds, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (row.step, row.reward, row.pass_at_1, row.pass_at_k, row.k, row.prompts, row.seconds, time.time()),
            )

    def evals(self, limit: int) -> list[EvalPoint]:
        """The newest `limit` evaluations, oldest first."""
        rows = self._rows("SELECT * FROM (SELECT * FROM evals ORDER BY step DESC LIMIT ?) ORDER BY step", (limit,))
        return [EvalPoint(**{k: v for k, v in r.items() if k != "created_at"}) for r in rows]


def _metrics(record: StepRecord) -> dict[str, float | None]:
    """The step row's metrics JSON: its extra figures and its S (the columns hold the rest)."""
    budget = {} if record.staleness_budget is None else {"staleness_budget": float(record.staleness_budget)}
    return {**record.extra, **budget}
