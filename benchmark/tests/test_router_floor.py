"""router_floor.py as a real process: its reader and trivial shard children run, and the figures add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "router_floor.py"


def test_floor_is_the_writes_plus_the_decode_call(tmp_path: Path) -> None:
    report_path = tmp_path / "floor.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--streams",
            "4",
            "--steps",
            "5",
            "--pauses-ms",
            "0,1",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("of router CPU per decode step") == 2
    report = json.loads(report_path.read_text())
    assert [r["pause_ms"] for r in report] == [0.0, 1.0]
    for r in report:
        assert r["streams"] == 4 and r["writes_ms_per_step"] > 0 and r["decode_call_ms_per_step"] > 0
        assert r["floor_ms_per_step"] == pytest.approx(r["writes_ms_per_step"] + r["decode_call_ms_per_step"])
        assert r["us_per_write"] * 4 / 1e3 == pytest.approx(r["writes_ms_per_step"])
