"""Why the staleness budget S moved (`--staleness auto`): the reasons and the record of one move, shared by the
hub that decides (hub/control/staleness.py), its status board and the dashboards that show S over time."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class StalenessReason(StrEnum):
    """Why S is what it is; the value is what status, events and metrics show."""

    START = "start"
    POOL_SHORT = "pool short of mu_min"
    BROADCAST = "cheaper hiding the broadcast"
    DRIFT = "drift near its bound"
    CHEAPER_LOWER = "fresher at no extra cost"


class StalenessMove(BaseModel):
    """S and kappa in force from `step` on, and why (drift: mean |log-ratio| when it was decided)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int = Field(ge=0)
    staleness: int = Field(ge=0, le=64)
    kappa: int = Field(ge=1, le=64)
    reason: StalenessReason
    drift: float | None = Field(None, ge=0.0)
    detail: str = Field("", max_length=300)


def moves_text(moves: Sequence[StalenessMove], last: int = 4) -> str:
    """The newest `last` moves of S, oldest first, as one line: "S=2 at step 6 (pool short of mu_min), ..."."""
    return ", ".join(f"S={m.staleness} at step {m.step} ({m.reason.value})" for m in moves[-last:])
