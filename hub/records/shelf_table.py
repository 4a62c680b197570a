"""The published snapshots: what distribution writes."""

from __future__ import annotations

import time

from hub.records.schema import NewEvent, SnapshotRow
from hub.records.table import Table


class ShelfTable(Table):
    """The published snapshots: what distribution writes."""

    def add_snapshot(self, version: int, path: str, manifest_hash: str, total_bytes: int, created_at: float) -> None:
        """Record a published snapshot; versions must strictly increase."""
        with self._write():
            latest = self.db.execute("SELECT MAX(version) FROM snapshots").fetchone()[0]
            if latest is not None and version <= latest:
                raise ValueError(f"snapshot version {version} is not newer than the latest {latest}")
            self.db.execute(
                "INSERT INTO snapshots (version, path, manifest_hash, total_bytes, created_at, published_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (version, path, manifest_hash, total_bytes, created_at, time.time()),
            )

    def set_broadcast_time(self, version: int, t_bcast_s: float, event: NewEvent | None = None) -> None:
        with self._write():
            self.db.execute("UPDATE snapshots SET t_bcast_s = ? WHERE version = ?", (t_bcast_s, version))
            self._events([event] if event else [])

    def latest_version(self) -> int | None:
        return self._rows("SELECT MAX(version) AS v FROM snapshots")[0]["v"]

    def newest_versions(self, count: int) -> list[int]:
        """The newest `count` published versions, oldest first."""
        rows = self._rows("SELECT version FROM snapshots ORDER BY version DESC LIMIT ?", (count,))
        return [int(r["version"]) for r in reversed(rows)]

    def snapshots(self) -> list[SnapshotRow]:
        return [SnapshotRow(**r) for r in self._rows("SELECT * FROM snapshots ORDER BY version")]
