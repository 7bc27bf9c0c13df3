"""shard_w1.py against a real tiny shard (conftest.py): every request runs to its end, numbers printed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def test_every_request_ends_and_figures_are_printed(
    tiny_llama: Path, tmp_path: Path, run_script: Callable[..., str]
) -> None:
    report_path = tmp_path / "w1.json"
    # A prefill budget shorter than the prompts: they go in chunks that join the running batch, and finished
    # requests are filtered out while others still run.
    out = run_script(
        *("shard_w1", "--model-dir", str(tiny_llama), "-n", "4", "--threads", "1", "--max-input-tokens", "300"),
        *("--max-batch-prefill-tokens", "64", "--json", str(report_path)),
    )
    for figure in ("tok/s", "prefill total", "decode steps", "median decode step", "shard CPU", "FLOP ceiling"):
        assert figure in out, figure
    report = json.loads(report_path.read_text())
    assert report["requests"] == 4 and report["prefills"] >= 2  # 4 prompts of more than 64 tokens in all
    for outcome in report["outcomes"]:
        if outcome["finish_reason"] == "eos_token":
            assert outcome["generated_tokens"] <= outcome["max_new_tokens"]
        else:
            assert (outcome["finish_reason"], outcome["generated_tokens"]) == ("length", outcome["max_new_tokens"])
    # Only the EOS token is special, so at most one token per request is not counted.
    ended = sum(o["generated_tokens"] for o in report["outcomes"])
    assert ended - 4 <= report["generated_tokens"] <= ended
    assert report["decode_steps"] >= max(o["generated_tokens"] for o in report["outcomes"]) - 1
    assert report["throughput_tok_s"] > 0 and report["shard_cpu_s"] > 0
    # Every token fed once: each prompt (less what the prefix cache held, at most the shared BOS) and each
    # generated token but the last; one row of logits per request in its prefill, one per row of each decode step.
    fed = sum(o["input_length"] + o["generated_tokens"] - 1 for o in report["outcomes"])
    rows = sum(step["rows"] for step in report["steps"])
    assert fed - 4 <= rows <= fed, (rows, fed)
    assert sum(step["logit_rows"] for step in report["steps"]) >= ended
    assert 0 < report["ceiling_s"] and report["ceiling_fraction"] == report["ceiling_s"] / report["wall_s"]
