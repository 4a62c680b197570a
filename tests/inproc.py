"""Pieces for assembling the real HubService in-process (tests and bench/p2p.py): trust defences that stay
out of the way of what is being measured, and a report handler for hubs that run no broadcaster."""

from __future__ import annotations

from pathlib import Path

from hub.config import TrustConfig
from hub.service import Defences
from hub.snapshots import SnapshotShelf
from shared.messages import BadChunkReport, Reject
from shared.rollout import SamplingParams
from shared.wire import read_message, write_message

# No audits, full-size leases from the first one, limits far above what a test drives.
PERMISSIVE_TRUST = TrustConfig(
    audit_rate=0.0, audit_first_n=0, trusted_after_audits=0, max_open_leases_per_peer=64,
    requests_per_s=1e5, request_burst=100_000, max_streams_per_peer=1024,
)


async def _ignore(*_args) -> None:
    return None


def permissive_defences(model_dir: Path, shelf: SnapshotShelf, sampling: SamplingParams, prompts_per_lease: int) -> Defences:
    return Defences.build(PERMISSIVE_TRUST, model_dir, shelf, sampling, prompts_per_lease, seed=0,
                          on_pass=_ignore, on_fail=_ignore)


async def refuse_reports(stream) -> None:
    await read_message(stream, BadChunkReport)
    await write_message(stream, Reject(reason="this hub runs no broadcaster"))
    await stream.close()
