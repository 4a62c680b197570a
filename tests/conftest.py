from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model, built once per cache (ECHO2_CACHE or ~/.cache/echo2)."""
    from shared.default_model import ensure_default_model

    return ensure_default_model(progress=False)
