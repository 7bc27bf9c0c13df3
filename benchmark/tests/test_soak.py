"""soak.py as a real process on the tiny llama for a few seconds: the report's shape, and nothing lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "soak.py"
COUNTS = (
    "completed",
    "rejected_429",
    "lost",
    "wrong_length",
    "server_5xx",
    "failed_424",
    "other_4xx",
    "dropped_streams",
    "stream_errors",
    "hostile",
)


def test_short_soak_reports_counts_rss_and_latency(tiny_llama: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-dir",
            str(tiny_llama),
            "--duration",
            "4",
            "--max-concurrent-requests",
            "3",
            "--max-new-tokens",
            "8",
            "--max-size-seconds",
            "1",
            "--huge-bytes",
            "100000",
            "--probes",
            "3",
            "--hostile-every",
            "0.5",
            "--sample-every",
            "0.5",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "small-request p50: idle" in done.stdout
    report = json.loads(report_path.read_text())
    counts = report["counts"]
    assert set(counts) == set(COUNTS)
    assert counts["lost"] == 0, done.stdout
    assert counts["completed"] > 0
    assert set(counts["hostile"]) <= {"bad_json", "temperature_1e-300", "huge_prompt", "lone_surrogate", "deep_nesting"}
    assert set(counts["hostile"]["bad_json"]) == {"400"}
    phases = [sample["phase"] for sample in report["rss"]]
    assert phases[0] == "idle" and phases[-1] == "after" and "soak" in phases
    assert all(s["router_mib"] > 0 and s["shard_mib"] > 0 for s in report["rss"])
    latency = report["latency"]
    assert latency["idle_n"] == 3 and latency["max_size_load_n"] >= 1
    assert latency["ratio"] == latency["max_size_load_p50_ms"] / latency["idle_p50_ms"]
