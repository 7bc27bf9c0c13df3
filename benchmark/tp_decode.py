"""Tensor-parallel scaling on the "small" Llama: decode tokens/s and per-shard peak RSS for 1 and N shards.

N real `textgen-server serve --sharded` processes (gloo on CPU) share --threads cores (threads / N
threads each, so every run uses the same cores) and are driven over gRPC with textgen-benchmark's loop via
the router's ShardedClient (Prefill, then Decode to the end; generations of all ranks concatenated).
Per-shard RSS: VmRSS once loaded (weights + runtime) and VmHWM (peak) at the end. The decode loop and the
shard helpers are shard_decode.py's (textgen_benchmark.decode, textgen_benchmark.shard).

Usage: python benchmark/tp_decode.py [--shards 1 --shards 2] [--batch 1 --batch 32] [--runs 3] [--model-dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from textgen_benchmark.decode import bytes_per_step, shard_steps
from textgen_benchmark.shard import small_model, stop
from textgen_common.ports import free_port


def start_shards(
    model_dir: Path, uds_path: str, num_shard: int, cores: int, timeout: float = 600.0
) -> list[subprocess.Popen]:
    """`num_shard` ranks, cores // num_shard threads each; returns once every rank's socket exists."""
    threads = str(max(1, cores // num_shard))
    port = str(free_port())
    procs = []
    for rank in range(num_shard):
        env = dict(
            os.environ,
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            RANK=str(rank),
            WORLD_SIZE=str(num_shard),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        log = open(Path(tempfile.gettempdir()) / f"textgen-tp-bench-{rank}.log", "wb")  # noqa: SIM115
        cmd = [
            sys.executable,
            "-m",
            "textgen_server.cli",
            "serve",
            str(model_dir),
            "--uds-path",
            uds_path,
            "--dtype",
            "float32",
        ] + (["--sharded"] if num_shard > 1 else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(f"{uds_path}-{r}") for r in range(num_shard)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                stop(p)
            raise RuntimeError(f"shards did not start; see {tempfile.gettempdir()}/textgen-tp-bench-*.log")
        time.sleep(0.2)
    return procs


def rss_mib(pid: int, field: str) -> float:
    """A memory line of /proc/PID/status in MiB: VmRSS (now) or VmHWM (peak)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1]) / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, action="append", help="shard counts (default 1, 2)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1, 32)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="cores shared by the shards")
    parser.add_argument("--model-dir", type=Path, help="a built model (default: build/cached small Llama)")
    args = parser.parse_args(argv)
    batches = args.batch or [1, 32]
    model_dir = args.model_dir or small_model()
    print(f"model {model_dir}, fp32, {args.threads} cores shared by the shards, runs {args.runs}", flush=True)
    rows = []
    for n in args.shards or [1, 2]:
        uds = f"/tmp/textgen-tp-bench-{os.getpid()}-{n}"
        procs = start_shards(model_dir, uds, n, args.threads)
        try:
            time.sleep(2)  # the socket appears just before the server starts serving
            loaded = [rss_mib(p.pid, "VmRSS") for p in procs]
            steps = asyncio.run(shard_steps(f"{uds}-0", procs[0].pid, model_dir, batches, args.runs))
            seconds = {b: step.wall for b, step in steps.items()}
            peak = [rss_mib(p.pid, "VmHWM") for p in procs]
        finally:
            for p in procs:
                stop(p)
        rows.append((n, seconds, loaded, peak))
    print(
        "\n| shards | RSS per shard when loaded (MiB) | peak RSS per shard (MiB) | "
        + " | ".join(f"batch {b} tok/s" for b in batches)
        + " | "
        + " | ".join(f"batch {b} GB/s" for b in batches)
        + " |"
    )
    print("|---:|---:|---:|" + "---:|" * (2 * len(batches)))
    for n, seconds, loaded, peak in rows:
        tps = " | ".join(f"{b / seconds[b]:.1f}" for b in batches)
        gbs = " | ".join(f"{bytes_per_step(model_dir, b) / seconds[b] / 1e9:.1f}" for b in batches)
        print(
            f"| {n} | {', '.join(f'{r:.0f}' for r in loaded)} | {', '.join(f'{r:.0f}' for r in peak)} | {tps} | {gbs} |"
        )


if __name__ == "__main__":
    main()
