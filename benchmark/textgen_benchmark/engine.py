"""What the v3 engine's end-to-end benchmarks (prefix_reuse.py, long_prompt.py) share: their common flags, the
small model they run on, and one real launcher per measured configuration."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from textgen_benchmark.servers import Launcher, Server
from textgen_benchmark.shard import DTYPES


def add_arguments(p: argparse.ArgumentParser, timeout: float) -> None:
    p.add_argument("--model-dir", help="the small Llama, built there when missing (default: the cached models/ build)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help=f"comma list of {', '.join(DTYPES)}: each is measured in turn (default bfloat16: the CPU's fast path)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the shard (default 1: on a shared 2-core box a second OpenMP thread spins "
        "for a descheduled sibling and makes step times noise; see README)",
    )
    p.add_argument("--timeout", type=float, default=timeout, help="seconds one measured run may take at most")
    p.add_argument("--json", help="also write every figure to this file")


def dtypes(args: argparse.Namespace) -> list[str]:
    chosen = args.dtype.split(",")
    if unknown := [d for d in chosen if d not in DTYPES]:
        raise SystemExit(f"--dtype: unknown {', '.join(unknown)}; expected {', '.join(DTYPES)}")
    return chosen


def model_dir(args: argparse.Namespace) -> Path:
    """--model-dir as it is where it holds a model (config.json), built there as the "small" Llama where it does
    not; else the cached build under models/."""
    from textgen_benchmark.shard import small_model
    from textgen_server.builder import build_test_model

    if not args.model_dir:
        return small_model()
    given = Path(args.model_dir)
    return given if (given / "config.json").is_file() else build_test_model(given, arch="llama", size="small")


def context_length(model: Path) -> int:
    """The model's max_position_embeddings: a prompt plus its new tokens must fit."""
    return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])


def start(name: str, model: Path, dtype: str, threads: int, flags: list[str], env: dict[str, str]) -> Server:
    """A launcher on `model` at `dtype` with `flags`, its shard on `threads` OpenMP threads, `env` added (the
    engine's switches: PREFIX_CACHING, PREFILL_CHUNKING, ATTENTION; this environment's reach it too, `env`
    winning)."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **env}
    # The launcher's --dtype takes float16 and bfloat16 only (TGI's choices); without it a CPU shard loads float32.
    dtype_flags = [] if dtype == "float32" else ["--dtype", dtype]
    return Launcher(name, str(model), [*dtype_flags, *flags], env)


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so the `finally` that stops the launchers runs when this script is killed."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
