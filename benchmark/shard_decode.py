"""Shard decode throughput against in-process transformers on the ~110M "small" Llama (`make bench`).

One real `textgen-server serve` process (fp32, 2 threads) on a unix socket is driven over gRPC: Prefill, then
Decode until done, at batch 1, 8 and 32. The shard is then stopped and the same model runs in this process
(same threads, batch, prompt length and new tokens: a bare greedy loop over a DynamicCache, the fastest a
transformers caller can go), so the ratio isolates what the serving path costs per decode step. Decode is
memory-bound at small batch, so each row also shows the fraction of a bandwidth roofline: bytes read per step
(weights except the embedding table, plus the batch's KV cache) over a measured copy bandwidth.

Usage: python benchmark/shard_decode.py [--batch 1 --batch 8 ...] [--runs 3] [--threads 2] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

PROMPT_LEN = 32
NEW_TOKENS = 17  # 1 from Prefill + 16 Decode steps
REPO = Path(__file__).resolve().parent.parent


def small_model() -> Path:
    """The cached "small" build under models/ (keyed by builder version so a stale build is never used)."""
    from textgen_server.builder import BUILDER_VERSION, build_test_model

    return build_test_model(REPO / "models" / f"small-llama-v{BUILDER_VERSION}", arch="llama", size="small")


DTYPES = ("float32", "bfloat16", "float16")  # a shard's --dtype choices


def start_shard(
    model_dir: Path, uds_path: str, threads: int, timeout: float = 300.0, dtype: str = "float32"
) -> subprocess.Popen:
    """A real shard process (`--dtype dtype`) limited to `threads` cores; returns once Health answers (or raises)."""
    import grpc

    from textgen_pb import generate_pb2, generate_pb2_grpc

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log = open(Path(tempfile.gettempdir()) / "textgen-bench-shard.log", "wb")  # noqa: SIM115 - child owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "textgen_server.cli", "serve", str(model_dir), "--uds-path", uds_path, "--dtype", dtype],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"shard exited with {proc.returncode}; see {log.name}")
        if os.path.exists(f"{uds_path}-0"):
            with grpc.insecure_channel(f"unix://{uds_path}-0") as channel:
                try:
                    generate_pb2_grpc.TextGenerationServiceStub(channel).Health(generate_pb2.HealthRequest(), timeout=5)
                    return proc
                except grpc.RpcError:
                    pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"shard not ready after {timeout}s; see {log.name}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@dataclass(frozen=True)
class Step:
    """Median wall seconds and CPU seconds per decode step (CPU time stays meaningful on a busy machine)."""

    wall: float
    cpu: float


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def shard_steps(socket: str, pid: int, model_dir: Path, batches: list[int], runs: int) -> dict[int, Step]:
    """Prefill then Decode until done over gRPC; per-step wall time here and CPU time of the shard process."""
    from tokenizers import Tokenizer

    from textgen_benchmark.generation import Sampling, make_batch, prompt_of_length
    from textgen_router.shard_client import ShardedClient

    shard = psutil.Process(pid)
    prompt = prompt_of_length(Tokenizer.from_file(str(model_dir / "tokenizer.json")), PROMPT_LEN)
    client = await ShardedClient.connect(socket)
    out: dict[int, Step] = {}
    try:
        await client.clear_cache(None)
        for b in batches:
            batch = make_batch(prompt, b, PROMPT_LEN, NEW_TOKENS, Sampling())
            walls: list[float] = []
            cpus: list[float] = []
            for run in range(runs + 1):  # the first run warms up
                cached = (await client.prefill(batch)).batch
                cpu, start, calls = cpu_seconds(shard), time.perf_counter(), 0
                while cached is not None:
                    cached = (await client.decode([cached])).batch
                    calls += 1
                if run:
                    walls.append((time.perf_counter() - start) / calls)
                    cpus.append((cpu_seconds(shard) - cpu) / calls)
                _progress(f"shard batch size {b}: {f'run {run}/{runs}' if run else 'warmup'}")
            out[b] = Step(statistics.median(walls), statistics.median(cpus))
    finally:
        await client.close()
    return out


@torch.inference_mode()
def inprocess_steps(
    model_dir: Path, batches: list[int], runs: int, threads: int, dtype: torch.dtype = torch.float32
) -> dict[int, Step]:
    """The same decode in transformers in this process: a bare greedy loop over a DynamicCache."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from textgen_benchmark.generation import prompt_of_length

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    text = prompt_of_length(Tokenizer.from_file(str(model_dir / "tokenizer.json")), PROMPT_LEN)
    # The shard tokenizes with special tokens and keeps the last `truncate` ids: do exactly the same.
    prompt = AutoTokenizer.from_pretrained(model_dir)(text).input_ids[-PROMPT_LEN:]
    out: dict[int, Step] = {}
    for b in batches:
        ids = torch.tensor([prompt] * b)
        walls: list[float] = []
        cpus: list[float] = []
        for run in range(runs + 1):  # the first run warms up
            cache = DynamicCache()
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
            cpu, start = time.process_time(), time.perf_counter()
            for _ in range(NEW_TOKENS - 1):
                logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits
                next_ids = logits[:, -1].argmax(-1, keepdim=True)
            if run:
                walls.append((time.perf_counter() - start) / (NEW_TOKENS - 1))
                cpus.append((time.process_time() - cpu) / (NEW_TOKENS - 1))
            _progress(f"in-process batch size {b}: {f'run {run}/{runs}' if run else 'warmup'}")
        out[b] = Step(statistics.median(walls), statistics.median(cpus))
    return out


def copy_bandwidth_gbs(threads: int, mib: int = 512) -> float:
    """Best of 5 large tensor copies (bytes read + written) with `threads` threads: achievable bandwidth."""
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def bytes_per_step(model_dir: Path, batch: int, itemsize: int = 4) -> float:
    """Weights read once per step (the embedding table is only gathered) + K and V of the whole batch, at
    `itemsize` bytes per value."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        weights = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "embed_tokens" not in k) * itemsize
    head_dim = config.hidden_size // config.num_attention_heads
    mean_context = PROMPT_LEN + NEW_TOKENS / 2
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * mean_context * batch * itemsize
    return weights + kv


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1, 8, 32)")
    parser.add_argument("--runs", type=int, default=3)
    # 2 threads on the 2-core target; on a shared, oversubscribed machine OpenMP threads that wait for a
    # descheduled sibling spin, so --threads 1 gives the more stable figures there.
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, help="a built model (default: build/cached small Llama)")
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="the shard's --dtype, and the in-process model's"
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    batches = args.batch or [1, 8, 32]
    model_dir = args.model_dir or small_model()
    uds = f"/tmp/textgen-bench-{os.getpid()}"
    print(
        f"model {model_dir}, {args.dtype}, {args.threads} threads, prompt {PROMPT_LEN}, new tokens {NEW_TOKENS}, "
        f"runs {args.runs}",
        flush=True,
    )
    proc = start_shard(model_dir, uds, args.threads, dtype=args.dtype)
    try:
        shard = asyncio.run(shard_steps(f"{uds}-0", proc.pid, model_dir, batches, args.runs))
    finally:
        stop(proc)
    local = inprocess_steps(model_dir, batches, args.runs, args.threads, dtype)
    bandwidth = copy_bandwidth_gbs(args.threads)
    print(f"copy bandwidth ({args.threads} threads): {bandwidth:.1f} GB/s\n")
    # ratio = shard tokens/s over in-process tokens/s (target >= 0.9); "CPU" columns use CPU seconds per step,
    # which other processes on the machine disturb far less than wall time.
    print("| batch | shard tok/s | in-process tok/s | ratio | ratio (CPU) | shard GB/s | roofline fraction |")
    print("|------:|------------:|-----------------:|------:|------------:|-----------:|------------------:|")
    for b in batches:
        gbs = bytes_per_step(model_dir, b, dtype.itemsize) / shard[b].wall / 1e9
        print(
            f"| {b} | {b / shard[b].wall:.1f} | {b / local[b].wall:.1f} | {local[b].wall / shard[b].wall:.2f} | "
            f"{local[b].cpu / shard[b].cpu:.2f} | {gbs:.1f} | {gbs / bandwidth:.2f} |"
        )


if __name__ == "__main__":
    main()
