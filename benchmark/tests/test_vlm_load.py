"""vlm_load.py (W3) on the tiny llava_next with two requests: it runs end to end and reports both sides."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def test_w3_runs_on_a_tiny_vlm_and_reports_both_sides(run_script: Callable[..., str], tmp_path: Path) -> None:
    figures = tmp_path / "w3.json"
    args = ["--size", "tiny", "--arch", "llava_next", "-n", "2", "--max-new-tokens", "3", "--repeats", "1"]
    out = run_script("vlm_load", *args, "--json", str(figures))
    assert "| llava_next |" in out, out
    (row,) = json.loads(figures.read_text())
    assert row["errors"] == 0 and 0 < row["generated_tokens"] <= 2 * 3
    assert row["transformers_tok_s"] > 0 and row["repeat_first_ttft_p50_ms"] > 0 and row["prefill_forward_s"] > 0
