"""shard_decode.py --grammar / --speculate / --quantize / --decode-ahead and speculation_cost.py on the tiny model,
with real shard processes (conftest.py): they run and print their figures."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open

ONE_THREAD = ("--threads", "1")


def test_grammar_option_measures_constrained_against_free_steps(
    tiny_llama: Path, run_script: Callable[..., str]
) -> None:
    # a schema the shard refused would fail the Prefill
    out = run_script(
        "shard_decode", "--grammar", "--model-dir", str(tiny_llama), "--batch", "4", "--runs", "1", *ONE_THREAD
    )
    assert re.search(r"a new schema compiles in [0-9.]+ ms per request", out), out
    assert re.search(r"^\| 4 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", out, re.MULTILINE), out


def test_speculate_option_measures_a_guessing_shard_against_a_plain_one(
    tiny_llama: Path, run_script: Callable[..., str]
) -> None:
    out = run_script(
        *("shard_decode", "--speculate", "3", "--cycling", "--model-dir", str(tiny_llama)),
        *("--batch", "2", "--runs", "1", *ONE_THREAD),
    )
    # The CPU ratio is nan when the tiny model's steps took less than a tick of the shard's CPU clock.
    row = re.search(r"^\| 2 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| (?:[0-9.]+|nan) \| [0-9.]+ / ([0-9.]+) \|$", out, re.M)
    assert row, out
    assert float(row.group(1)) > 1  # the looping model's guesses were confirmed


def test_decode_ahead_option_measures_a_shard_with_it_against_one_without(
    tiny_llama: Path, run_script: Callable[..., str]
) -> None:
    out = run_script(
        "shard_decode", "--decode-ahead", "--model-dir", str(tiny_llama), "--batch", "1", "--runs", "2", *ONE_THREAD
    )
    assert re.search(r"^\| 1 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \([0-9.]+-[0-9.]+\) \|$", out, re.M), out


def test_speculation_cost_times_refused_guesses(tiny_llama: Path, run_script: Callable[..., str]) -> None:
    out = run_script("speculation_cost", "--model-dir", str(tiny_llama), "--batch", "2", *ONE_THREAD)
    assert re.search(r"^\| 2 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", out, re.M), out


def test_quantize_option_measures_quantized_against_float_shards(
    tiny_llama: Path, tmp_path: Path, run_script: Callable[..., str]
) -> None:
    model = tmp_path / "llama"  # the quantized build is written beside the model it quantizes
    model.symlink_to(tiny_llama, target_is_directory=True)
    out = run_script(
        *("shard_decode", "--quantize", "gptq", "--group-size", "32", "--lm-head", "--model-dir", str(model)),
        *("--batch", "1", "--runs", "1", *ONE_THREAD),
    )
    row = r"^\| 1 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$"
    assert re.search(row, out, re.M), out
    (built,) = tmp_path.glob("llama-gptq4-g32-head-q*")
    assert "lm_head.qweight" in safe_open(built / "model.safetensors", "pt").keys()


def test_lm_head_goes_with_gptq_only(run_script: Callable[..., str]) -> None:
    with pytest.raises(SystemExit):
        run_script("shard_decode", "--quantize", "eetq", "--lm-head")
