"""shard_decode.py --grammar as a real process against a real tiny shard: constrained batches run, figures print."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "shard_decode.py"


def test_grammar_option_measures_constrained_against_free_steps(tiny_llama: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--grammar", "--model-dir", str(tiny_llama), "--batch", "4", "--runs", "1"]
        + ["--threads", "1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # a schema the shard refused would fail the Prefill
    assert re.search(r"a new schema compiles in [0-9.]+ ms per request", done.stdout), done.stdout
    assert re.search(r"^\| 4 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", done.stdout, re.MULTILINE), done.stdout
