"""The hub's shelf of published snapshots: manifests and open files of the newest ones, and their retention.

The shelf holds no weights in RAM: it serves chunks by pread from each snapshot's file (and from its
delta against the version before, shared/delta.py, when the learner made one). It keeps
the versions a rollout may still be generated from (the newest `keep` = S + 1) and deletes the
files of older ones as a new version arrives (manifest first; shared.snapshot.remove_snapshot_files),
so the snapshot directory holds at most S + 2 snapshots (each with its delta): the kept ones and the
one being written. A restarted hub shelves the newest `keep` again (`reopen`): work made with a version older than
the newest is audited, and so paid, after a restart as before it.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.snapshot import Manifest, SignedManifest, Snapshot, blake3_hex, read_chunk, read_snapshot_files, remove_snapshot_files

log = logging.getLogger("echo2.hub.snapshots")

_SNAPSHOT_FILE_RE = re.compile(r"v(\d{8})\.(safetensors|manifest|delta|delta-manifest)")


@dataclass(frozen=True)
class _File:
    snapshot: Snapshot
    fd: int
    manifest_digest: str  # what a relay serving it must commit to for its manifest frame (shared/transfer.py)

    @classmethod
    def open(cls, snapshot: Snapshot) -> _File:
        return cls(snapshot, os.open(snapshot.path, os.O_RDONLY), blake3_hex(snapshot.signed.to_bytes()))


@dataclass(frozen=True)
class _Held:
    full: _File
    delta: _File | None  # the version as a delta against the one before

    def close(self) -> None:
        for held in (self.full, self.delta):
            if held is not None:
                os.close(held.fd)


class SnapshotShelf:
    """Published snapshots by version; serves chunks from their files (a `shared.transfer.ChunkSource`)."""

    def __init__(self, keep: int, directory: Path | None = None) -> None:
        """`directory`: where the learner writes snapshots; files of versions that leave the shelf are
        deleted there (None: nothing is deleted, for shelves over files someone else owns)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.directory = directory
        self._by_version: OrderedDict[int, _Held] = OrderedDict()

    def prune(self, keep_versions: set[int]) -> int:
        """Delete every snapshot file in the directory but those of `keep_versions` (orphans of a crash,
        versions from before a restart that left the window); returns how many files went."""
        if self.directory is None or not self.directory.is_dir():
            return 0
        removed = 0
        for path in self.directory.iterdir():
            match = _SNAPSHOT_FILE_RE.fullmatch(path.name)
            if match is None and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write the crash interrupted
                removed += 1
            elif match is not None and int(match.group(1)) not in keep_versions:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def reopen(self, versions: Sequence[int], hub_peer_id: str) -> list[int]:
        """On a hub's start: shelve again, oldest first, the newest `keep` of `versions` (published by this hub before
        it stopped) whose files in the directory still pass their signed manifest, every chunk and the whole hash. One
        whose files are gone or fail is left off, logged (work made with it cannot be audited). The versions shelved."""
        if self.directory is None:
            raise ValueError("a shelf without a directory has no files to reopen")
        shelved = []
        for version in sorted(versions)[-self.keep :]:
            try:
                snapshot = read_snapshot_files(self.directory, version, hub_peer_id)
            except (OSError, ValueError) as exc:  # gone, cut short, or not what its manifest signs
                log.warning("snapshot v%d not shelved again: %s (work made with it cannot be audited)", version, exc)
                continue
            self.add(snapshot)
            shelved.append(version)
        return shelved

    def add(self, snapshot: Snapshot, delta: Snapshot | None = None) -> None:
        """Shelve a newly published version (the oldest beyond `keep` leave). The newest version again, as it is held
        and without a delta (the learner's first publish after a restart, of a version `reopen` shelved), is held once."""
        version = snapshot.manifest.version
        held = self._by_version.get(version)
        if held is not None and version == self.newest_version() and delta is None:
            if held.full.snapshot.manifest.whole_hash == snapshot.manifest.whole_hash:
                return
        if self._by_version and version <= self.newest_version():
            raise ValueError(f"snapshot v{version} is not newer than v{self.newest_version()}")
        if delta is not None and (delta.manifest.version, delta.manifest.result_hash) != (version, snapshot.manifest.whole_hash):
            raise ValueError(f"the delta given with v{version} does not produce it")
        self._by_version[version] = _Held(_File.open(snapshot), None if delta is None else _File.open(delta))
        while len(self._by_version) > self.keep:
            old, held = self._by_version.popitem(last=False)
            # A serve in progress holds its own reads to these fds: closing makes them fail as "no
            # longer held", which the transfer code treats like any abandoned version.
            held.close()
            if self.directory is not None:
                remove_snapshot_files(self.directory, old)
                log.debug("deleted snapshot v%d (out of the staleness window)", old)

    def close(self) -> None:
        for held in self._by_version.values():
            held.close()
        self._by_version.clear()

    def newest_version(self) -> int:
        return next(reversed(self._by_version)) if self._by_version else -1

    def versions(self) -> list[int]:
        return list(self._by_version)

    def get(self, version: int | None) -> Snapshot | None:
        if version is None:
            version = self.newest_version()
        held = self._by_version.get(version)
        return None if held is None else held.full.snapshot

    def delta(self, version: int) -> Snapshot | None:
        """`version`'s delta against the version published before it, if the learner made one."""
        held = self._by_version.get(version)
        return None if held is None or held.delta is None else held.delta.snapshot

    def manifest_digest(self, version: int, delta: bool = False) -> str | None:
        """blake3 of the signed manifest bytes of `version` (or of its delta), if held."""
        held = self._file(version, delta)
        return None if held is None else held.manifest_digest

    def _file(self, version: int, delta: bool) -> _File | None:
        held = self._by_version.get(version)
        if held is None:
            return None
        return held.delta if delta else held.full

    def held_manifest(self, version: int | None, base_version: int | None = None) -> tuple[SignedManifest, Manifest] | None:
        if version is None:
            version = self.newest_version()
        delta = self._file(version, True)
        if delta is not None and base_version is not None and delta.snapshot.manifest.base_version == base_version:
            return delta.snapshot.signed, delta.snapshot.manifest
        full = self._file(version, False)
        return None if full is None else (full.snapshot.signed, full.snapshot.manifest)

    async def chunk(self, version: int, index: int, delta: bool = False) -> bytes:
        held = self._file(version, delta)
        if held is None:
            raise LookupError(f"snapshot v{version}{' delta' if delta else ''} no longer held")
        return read_chunk(held.fd, held.snapshot.manifest, index)
