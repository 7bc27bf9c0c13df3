"""llama.cpp as the CPU peer (issue 42): where ../shared/tools/llama-cpp-peer.sh builds `llama-bench` and writes
each model's GGUF files, llama-bench's batch-1 decode rate with the issue's command, and textgen's runs as ratios
over the llama.cpp runs either side of each (`shard_decode.py --peer`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

# The peer script's CACHE: llama.cpp's build and `<model>-bf16.gguf`, `<model>-Q8_0.gguf`, ... beside it.
PEER_CACHE = Path(os.environ.get("CACHE", Path.home() / ".cache" / "textgen-peer"))
LLAMA_BENCH = PEER_CACHE / "llama.cpp" / "build" / "bin" / "llama-bench"


def llama_bench_tokens_per_second(binary: Path, gguf: Path, threads: int) -> float:
    """llama-bench's batch-1 decode rate on `gguf` (tokens/s, the mean of its 3 repetitions of 64 tokens)."""
    out = subprocess.run(
        [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "64", "-r", "3", "-o", "json"],
        env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)},  # its libllama / libggml lie beside it
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (test,) = json.loads(out)
    return float(test["avg_ts"])


def bracketed_ratios(ours: list[float], peers: list[float]) -> list[float]:
    """ours[i] over the mean of the peer's runs either side of it (peers[i], peers[i + 1]): a drift of the host's
    speed within minutes then moves both sides of a ratio."""
    if len(peers) != len(ours) + 1:
        raise ValueError(f"{len(ours)} runs need {len(ours) + 1} peer runs around them, got {len(peers)}")
    return [x / ((peers[i] + peers[i + 1]) / 2) for i, x in enumerate(ours)]
