"""The hub's shelf of published snapshots: the newest S+1 kept in memory to serve and to audit against."""

from __future__ import annotations

from collections import OrderedDict

from shared.snapshot import Manifest, SignedManifest, Snapshot, blake3_hex, chunk_of


class SnapshotShelf:
    """Published snapshots by version; serves chunks (a `shared.transfer.ChunkSource`)."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._by_version: OrderedDict[int, Snapshot] = OrderedDict()
        self._manifest_digests: dict[int, str] = {}

    def add(self, snapshot: Snapshot) -> None:
        version = snapshot.manifest.version
        if self._by_version and version <= self.newest_version():
            raise ValueError(f"snapshot v{version} is not newer than v{self.newest_version()}")
        self._by_version[version] = snapshot
        # What a relay serving this version must commit to for its manifest frame (shared/transfer.py).
        self._manifest_digests[version] = blake3_hex(snapshot.signed.to_bytes())
        while len(self._by_version) > self.keep:
            old, _ = self._by_version.popitem(last=False)
            del self._manifest_digests[old]

    def newest_version(self) -> int:
        return next(reversed(self._by_version)) if self._by_version else -1

    def get(self, version: int | None) -> Snapshot | None:
        if version is None:
            version = self.newest_version()
        return self._by_version.get(version)

    def manifest_digest(self, version: int) -> str | None:
        """blake3 of the signed manifest bytes of `version`, if held."""
        return self._manifest_digests.get(version)

    def held_manifest(self, version: int | None) -> tuple[SignedManifest, Manifest] | None:
        snapshot = self.get(version)
        return None if snapshot is None else (snapshot.signed, snapshot.manifest)

    async def chunk(self, version: int, index: int) -> bytes:
        snapshot = self.get(version)
        if snapshot is None:
            raise LookupError(f"snapshot v{version} no longer held")
        return bytes(chunk_of(snapshot.data, snapshot.manifest, index))
