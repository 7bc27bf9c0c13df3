"""Shard decode steps over gRPC and their bandwidth roofline, shared by benchmark/shard_decode.py and
benchmark/tp_decode.py (and the CPU copy bandwidth by attention.py and linear_pack.py)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from textgen_benchmark.shard import cpu_seconds

PROMPT_LEN = 32
NEW_TOKENS = 17  # 1 from Prefill + 16 Decode steps


@dataclass(frozen=True)
class Step:
    """Median wall seconds and CPU seconds per decode step (CPU time stays meaningful on a busy machine); with
    speculation, per token of a row, `tokens` being the tokens a row emitted per Decode call and `fed` the tokens
    a row's forward computed (its last and its guesses)."""

    wall: float
    cpu: float
    tokens: float = 1.0
    fed: float = 1.0


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def shard_steps(
    socket: str,
    pid: int,
    model_dir: Path,
    batches: list[int],
    runs: int,
    *,
    schemas: Sequence[str] = (),
    adapters: Sequence[str] = (),
) -> dict[int, Step]:
    """Prefill then Decode until done over gRPC; per-step wall time here and CPU time of the shard process.

    Request i of a batch is constrained by the JSON schema `schemas[i % len(schemas)]` and runs with the LoRA
    adapter `adapters[i % len(adapters)]` (when given): neighbouring rows differ."""
    from tokenizers import Tokenizer

    from textgen_benchmark.generation import Sampling, make_batch, prompt_of_length
    from textgen_pb import generate_pb2
    from textgen_router.shard_client import ShardedClient

    shard = psutil.Process(pid)
    prompt = prompt_of_length(Tokenizer.from_file(str(model_dir / "tokenizer.json")), PROMPT_LEN)
    client = await ShardedClient.connect(socket)
    out: dict[int, Step] = {}
    try:
        await client.clear_cache(None)
        for b in batches:
            batch = make_batch(prompt, b, PROMPT_LEN, NEW_TOKENS, Sampling())
            for i, request in enumerate(batch.requests):
                if schemas:
                    request.parameters.grammar = schemas[i % len(schemas)]
                    request.parameters.grammar_type = generate_pb2.GRAMMAR_TYPE_JSON
                if adapters:
                    request.adapter_id = adapters[i % len(adapters)]
            walls: list[float] = []
            cpus: list[float] = []
            calls_per_run: list[int] = []
            fed: list[float] = []  # per Decode call: tokens its forward computed per row
            for run in range(runs + 1):  # the first run warms up
                cached = (await client.prefill(batch)).batch
                cpu, start, calls = cpu_seconds(shard), time.perf_counter(), 0
                while cached is not None:
                    fed.append(cached.current_tokens / cached.size)
                    cached = (await client.decode([cached])).batch
                    calls += 1
                if run:
                    # Every row emits NEW_TOKENS - 1 tokens in Decode calls: one a call unless the shard speculates.
                    walls.append((time.perf_counter() - start) / (NEW_TOKENS - 1))
                    cpus.append((cpu_seconds(shard) - cpu) / (NEW_TOKENS - 1))
                    calls_per_run.append(calls)
                progress(f"shard batch size {b}: {f'run {run}/{runs}' if run else 'warmup'}")
            tokens = (NEW_TOKENS - 1) / max(calls_per_run)
            out[b] = Step(statistics.median(walls), statistics.median(cpus), tokens, statistics.mean(fed))
    finally:
        await client.close()
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


def bytes_per_step(model_dir: Path, batch: int, itemsize: int = 4, mean_context: float | None = None) -> float:
    """Weights read once per step (the embedding table is only gathered) + K and V of the whole batch, at
    `itemsize` bytes per value, over `mean_context` positions per row (default: this module's decode's)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        weights = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "embed_tokens" not in k) * itemsize
    return weights + kv_bytes_per_step(model_dir, batch, itemsize, mean_context)


def kv_bytes_per_step(model_dir: Path, batch: int, itemsize: int, mean_context: float | None = None) -> float:
    """K and V of the whole batch read by one decode step, over `mean_context` positions per row."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    if mean_context is None:
        mean_context = PROMPT_LEN + NEW_TOKENS / 2
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * mean_context * batch * itemsize
