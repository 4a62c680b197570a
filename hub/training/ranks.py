"""Which learner rank this process is, from what torchrun (or --learner-procs) put in its environment.

Kept apart from hub/training/distributed.py, which imports torch, so that `echo-hub start` can tell a rank from
the hub and refuse a mistake in one line without paying for that import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankEnv:
    """What torchrun (or --learner-procs) put in the environment of one learner rank."""

    rank: int
    world: int
    local_rank: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # The ranks of --learner-procs meet in this file (mode 0600) instead of a TCP store: hub/training/distributed.py.
    store_file: str | None = None


RANK_STORE_ENV = "ECHO2_RANK_STORE"


def rank_env() -> RankEnv | None:
    """This process's rank, if it was launched as one (RANK and WORLD_SIZE set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return RankEnv(
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(os.environ.get("MASTER_PORT", "29500")),
        store_file=os.environ.get(RANK_STORE_ENV),
    )
