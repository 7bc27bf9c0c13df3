"""textgen-benchmark as a real process against a real tiny shard on a unix socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from textgen_benchmark.stats import Latency

BENCH = [sys.executable, "-m", "textgen_benchmark.main"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=180)


def test_benchmark_tables_json_and_plot(tiny_llama: Path, start_shard: Callable[..., object], tmp_path: Path) -> None:
    shard = start_shard(tiny_llama)
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = run(
        "-t",
        str(tiny_llama),
        "-m",
        shard.socket,
        "-b",
        "1",
        "-b",
        "3",
        "-s",
        "6",
        "-d",
        "4",
        "-r",
        "2",
        "-w",
        "1",
        "--top-n-tokens",
        "2",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    )
    assert done.returncode == 0, done.stderr
    for heading in (
        "| Parameter",
        "| Step",
        "| Prefill        | 1",
        "| Decode (token) | 3",
        "| Decode (total) | 1",
        "tokens/secs",
        "| Sequence Length    | 6",
        # TGI's table writes options as Rust's Debug does and flags as true/false.
        "| Top N Tokens       | Some(2)",
        "| Temperature        | None",
        "| Watermark          | false",
    ):
        assert heading in done.stdout, heading
    assert "batch size 3: run 2/2" in done.stderr
    document = json.loads(out_json.read_text())
    assert document["parameters"]["Decode Length"] == 4
    sizes = [r["batch_size"] for r in document["results"]]
    assert sizes == [1, 3]
    for r in document["results"]:
        assert 0 < r["prefill"]["lowest"] <= r["prefill"]["average"] <= r["prefill"]["highest"]
        # 4 new tokens = 1 from Prefill + 3 Decode calls, so total ≈ 3 × per-token.
        assert r["decode_total"]["average"] == pytest.approx(3 * r["decode_token"]["average"])
        assert r["decode_throughput"]["average"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --json - : the document alone on stdout, machine-readable.
    piped = run(
        "-t", str(tiny_llama), "-m", shard.socket, "-b", "2", "-s", "4", "-d", "1", "-r", "1", "-w", "0", "--json", "-"
    )
    assert piped.returncode == 0, piped.stderr
    only = json.loads(piped.stdout)
    # Decode length 1: the first token comes from Prefill, so there are no Decode samples.
    assert only["results"][0]["decode_token"]["average"] is None


def test_unreachable_shard_is_one_line(tiny_llama: Path) -> None:
    done = run("-t", str(tiny_llama), "-m", f"/tmp/tg-bench-nobody-{os.getpid()}-0", "-b", "1", "-r", "1")
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error: shard at /tmp/")
    assert len(done.stderr.strip().splitlines()) == 1


def test_bad_arguments(tiny_llama: Path, tmp_path: Path) -> None:
    zero = run("-t", str(tiny_llama), "-b", "0")
    assert zero.returncode == 2 and "must be at least 1, got 0" in zero.stderr
    # TGI's warmups, top-k and top-n are unsigned: clap refuses a negative one before anything runs.
    for flag in ("-w", "--top-k", "--top-n-tokens"):
        negative = run("-t", str(tiny_llama), flag, "-3")
        assert negative.returncode == 2 and "invalid value '-3': invalid digit found in string" in negative.stderr
    missing = run("-m", "/tmp/nowhere-0")
    assert missing.returncode == 2 and "--tokenizer-name" in missing.stderr
    no_tok = run("-t", str(tmp_path / "none"), "-b", "1", "-r", "1", "--revision", "main")
    assert no_tok.returncode == 1 and no_tok.stderr.startswith("error: cannot load tokenizer")


def test_percentiles_follow_tgi_index_rule() -> None:
    lat = Latency.of([float(v) for v in range(1, 11)])  # index floor(p/100 * 10)
    assert (lat.p50, lat.p90, lat.p99, lat.lowest, lat.highest, lat.average) == (6.0, 10.0, 10.0, 1.0, 10.0, 5.5)
