"""shard_decode.py --grammar / --speculate / --quantize / --decode-ahead / --peer and speculation_cost.py on the tiny
model, with real shard processes (conftest.py): they run and print their figures."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open

from textgen_benchmark.peer import LLAMA_BENCH, PEER_CACHE, bracketed_ratios

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


def test_peer_ratios_divide_each_run_by_the_peer_runs_either_side() -> None:
    assert bracketed_ratios([100.0, 90.0], [200.0, 100.0, 80.0]) == [100 / 150, 90 / 90]
    with pytest.raises(ValueError, match="2 runs need 3 peer runs"):
        bracketed_ratios([100.0, 90.0], [200.0, 100.0])


def test_peer_option_refuses_what_it_cannot_measure(
    tmp_path: Path, run_script: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(SystemExit):
        run_script("shard_decode", "--peer", str(gguf), "--llama-bench", str(tmp_path / "none"))
    assert "no llama-bench at" in capsys.readouterr().err
    for other in (("--decode-ahead",), ("--speculate", "2")):
        with pytest.raises(SystemExit):
            run_script("shard_decode", "--peer", str(gguf), *other)
        assert "--peer measures the model as it is, not with " + other[0] in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_script("shard_decode", "--llama-bench", str(tmp_path / "none"))
    assert "--llama-bench goes with --peer" in capsys.readouterr().err


@pytest.mark.skipif(
    not (LLAMA_BENCH.is_file() and any(PEER_CACHE.glob("*-bf16.gguf"))),
    reason="llama.cpp's llama-bench and a GGUF: ../shared/tools/llama-cpp-peer.sh builds them",
)
def test_peer_option_alternates_the_shard_with_llama_bench(tiny_llama: Path, run_script: Callable[..., str]) -> None:
    gguf = next(PEER_CACHE.glob("*-bf16.gguf"))  # any model: this checks the alternation, not a ratio
    out = run_script("shard_decode", "--peer", str(gguf), "--model-dir", str(tiny_llama), "--runs", "2", *ONE_THREAD)
    rows = re.findall(r"^\| (\d) \| [0-9.]+ \| ([0-9.]+) / ([0-9.]+) \| [0-9.]+ \|$", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"], out
    assert rows[0][2] == rows[1][1], out  # the llama.cpp run between two shard runs brackets both
    assert re.search(r"textgen / llama.cpp per run [0-9.]+ \([0-9.]+-[0-9.]+\)", out), out
