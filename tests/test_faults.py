"""Every fault scenario of bench/faults.py, in its quick size, against real processes on loopback:
cheats are detected and neither trained on nor paid, honest work is never refused, a SIGKILLed
hub loses and double-counts nothing, and the run survives losing 30% of its nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fault_scenarios_quick(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "faults.py"), "--json", "--quick", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=880, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["scenarios"], report
    for s in report["scenarios"]:
        assert s["attempts"] > 0, s
        assert s["detected"] == s["attempts"], s
        assert s["accepted"] == 0, s
        assert s["false_rejections"] == 0, s
        assert s["shown_cost_matches_ledger"], s
        if s["name"] != "fake_reward":  # the lie earns nothing, the genuine sampling under it is paid
            assert s["paid"] <= 0.0, s
    crash = report["crash"]
    assert crash["kills"] >= 2 and crash["integrity_ok"] and crash["versions_monotone"], crash
    assert (crash["lost"], crash["double_counted"], crash["paid_twice"]) == (0, 0, 0), crash
    churn = report["churn"]
    assert churn["run_completed"] and churn["survivors_with_snapshot"] == churn["survivors"], churn
