"""shard_w1.py as a real process against a real tiny shard: every request runs to its end, numbers printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "shard_w1.py"


def test_every_request_ends_and_figures_are_printed(tiny_llama: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "w1.json"
    # A prefill budget shorter than the prompts: they go in chunks that join the running batch, and finished
    # requests are filtered out while others still run.
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-dir",
            str(tiny_llama),
            "-n",
            "4",
            "--threads",
            "1",
            "--max-input-tokens",
            "300",
            "--max-batch-prefill-tokens",
            "64",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for figure in ("tok/s", "prefill total", "decode steps", "median decode step", "shard CPU"):
        assert figure in done.stdout, figure
    report = json.loads(report_path.read_text())
    assert report["requests"] == 4 and report["prefills"] >= 2  # 4 prompts of more than 64 tokens in all
    for out in report["outcomes"]:
        if out["finish_reason"] == "eos_token":
            assert out["generated_tokens"] <= out["max_new_tokens"]
        else:
            assert (out["finish_reason"], out["generated_tokens"]) == ("length", out["max_new_tokens"])
    # Only the EOS token is special, so at most one token per request is not counted.
    ended = sum(o["generated_tokens"] for o in report["outcomes"])
    assert ended - 4 <= report["generated_tokens"] <= ended
    assert report["decode_steps"] >= max(o["generated_tokens"] for o in report["outcomes"]) - 1
    assert report["throughput_tok_s"] > 0 and report["shard_cpu_s"] > 0
