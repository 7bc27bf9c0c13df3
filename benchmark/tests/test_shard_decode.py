"""shard_decode.py --grammar / --speculate / --quantize and speculation_cost.py as real processes on the tiny model:
they run and print their figures."""

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


def test_speculate_option_measures_a_guessing_shard_against_a_plain_one(tiny_llama: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--speculate", "3", "--cycling", "--model-dir", str(tiny_llama)]
        + ["--batch", "2", "--runs", "1", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The CPU ratio is nan when the tiny model's steps took less than a tick of the shard's CPU clock.
    row = re.search(
        r"^\| 2 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| (?:[0-9.]+|nan) \| [0-9.]+ / ([0-9.]+) \|$", done.stdout, re.M
    )
    assert row, done.stdout
    assert float(row.group(1)) > 1  # the looping model's guesses were confirmed


def test_speculation_cost_times_refused_guesses(tiny_llama: Path) -> None:
    script = SCRIPT.with_name("speculation_cost.py")
    done = subprocess.run(
        [sys.executable, str(script), "--model-dir", str(tiny_llama), "--batch", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^\| 2 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", done.stdout, re.M), done.stdout


def test_quantize_option_measures_quantized_against_float_shards(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "llama"  # the quantized build is written beside the model it quantizes
    model.symlink_to(tiny_llama, target_is_directory=True)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quantize", "gptq", "--group-size", "32", "--model-dir", str(model)]
        + ["--batch", "1", "--runs", "1", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = r"^\| 1 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$"
    assert re.search(row, done.stdout, re.M), done.stdout
