"""W1 straight into one shard, scheduled by the router's own inference side: the shard-only baseline of the
end-to-end HTTP run (issue 3).

The requests are validated by the router's Validator (so the shard receives exactly the Requests an HTTP
/generate_stream call with {"max_new_tokens": N} becomes: greedy, no stop sequences, EOS honoured,
truncate = max_input_tokens), then run by the router's start-up (`textgen_router.backend.warm_up`: Warmup,
the settled limits) and its batching loop (Queue, Batcher, Infer) under the same budgets and the launcher's
scheduling flags (waiting_served_ratio, max_waiting_tokens, max_batch_size) as the end-to-end run: the same
schedule, without the router process, HTTP and tokenizer-side streaming. All requests are queued before the
batching loop first wakes (burst arrival).

Throughput is defined as in http_load: generated non-special tokens / wall time from the first request
queued to the last token received. Prefill and Decode are timed around the gRPC calls, and the rows each one
feeds are kept: after the shard stops, the run's projections' FLOP ceiling (textgen_benchmark.ceiling) is
measured for those steps on the same CPU.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import torch

from textgen_benchmark.ceiling import Ceiling, Step
from textgen_benchmark.shard import cpu_seconds, start_shard, stop
from textgen_benchmark.w1 import Budgets, Job, request_body
from textgen_launcher.args import parse_args as launcher_args
from textgen_pb import generate_pb2
from textgen_router.backend import warm_up
from textgen_router.config import RouterConfig
from textgen_router.infer import Infer
from textgen_router.schemas import GenerateRequest
from textgen_router.shard_client import ShardedClient, StepResult
from textgen_router.tokenizer import load_tokenizer
from textgen_router.types import EndEvent, PrefillEvent, ValidRequest
from textgen_router.validation import Limits, Validator


@dataclass
class Outcome:
    """One request's end: `generated_tokens` and `finish_reason` as the shard's GeneratedText reports them."""

    id: int
    max_new_tokens: int
    input_length: int
    generated_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class Report:
    requests: int
    threads: int
    budgets: Budgets
    generated_tokens: int = 0
    wall_s: float = 0.0
    throughput_tok_s: float = 0.0
    prefills: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_step_p50_ms: float = 0.0
    shard_cpu_s: float = 0.0
    ceiling_s: float = 0.0  # the steps' projections at the fastest measured rate (textgen_benchmark.ceiling)
    ceiling_tok_s: float = 0.0
    ceiling_fraction: float = 0.0  # ceiling_s / wall_s
    outcomes: list[Outcome] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)


class TimedClient(ShardedClient):
    """The router's ShardedClient, recording the wall seconds of every Prefill and Decode call and the rows each
    feeds (`steps`). A Prefill's rows are its requests' uncached prompt tokens (or first chunk): `input_lengths`
    maps each prompt text to its token count, as the router's validation counted it."""

    def __init__(self, channels: list[grpc.aio.Channel]) -> None:
        super().__init__(channels)
        self.prefill_s: list[float] = []
        self.decode_s: list[float] = []
        self.steps: list[Step] = []
        self.input_lengths: dict[str, int] = {}

    async def prefill(
        self,
        batch: generate_pb2.Batch,
        cached_batch: generate_pb2.CachedBatch | None = None,
        sent: Callable[[], None] | None = None,
    ) -> StepResult:
        rows = sum(
            r.chunk_len if r.HasField("chunk_len") else self.input_lengths[r.inputs] - r.cache_len
            for r in batch.requests
        )
        riding = [cached_batch] if cached_batch is not None else []
        self.steps.append(
            Step(rows + sum(b.current_tokens for b in riding), len(batch.requests) + sum(b.size for b in riding))
        )
        start = time.perf_counter()
        try:
            return await super().prefill(batch, cached_batch, sent)
        finally:
            self.prefill_s.append(time.perf_counter() - start)

    async def decode(
        self, batches: Sequence[generate_pb2.CachedBatch], sent: Callable[[], None] | None = None
    ) -> StepResult:
        self.steps.append(Step(sum(b.current_tokens for b in batches), sum(b.size for b in batches)))
        start = time.perf_counter()
        try:
            return await super().decode(batches, sent)
        finally:
            self.decode_s.append(time.perf_counter() - start)


def router_config(model_dir: Path, budgets: Budgets, requests: int) -> RouterConfig:
    """The limits the launcher gives its router for `budgets` (its defaults for the other scheduling flags),
    with a permit for each of the `requests`."""
    argv = ["--model-id", str(model_dir), "--max-concurrent-requests", str(requests), *budgets.launcher_args()]
    return RouterConfig.from_args(launcher_args(argv))


async def _run_one(infer: Infer, request: ValidRequest, outcome: Outcome) -> int:
    """Stream `request` to its end into `outcome`; returns its generated non-special tokens."""
    tokens = 0
    async for event in infer.generate_stream(request):
        if isinstance(event, PrefillEvent):
            continue
        tokens += not event.token.special
        if isinstance(event, EndEvent):
            outcome.generated_tokens = event.generated_text.generated_tokens
            outcome.finish_reason = event.generated_text.finish_reason
    return tokens


async def drive(socket: str, pid: int, model_dir: Path, jobs: list[Job], budgets: Budgets, threads: int) -> Report:
    """Start the router's inference side on the shard, then run every job to its end."""
    config = router_config(model_dir, budgets, len(jobs))
    client = await TimedClient.connect(socket)  # ServiceDiscovery
    backend = await warm_up(client, config)
    try:
        # The launcher's defaults for the limits W1 does not touch.
        limits = Limits(2, 4, 5, backend.max_input_tokens, backend.max_total_tokens)
        validator = Validator(load_tokenizer(model_dir), limits, workers=2)
        requests = []
        for job in jobs:
            body = GenerateRequest.model_validate(request_body("generate", job, "tgi")[1])
            requests.append(await validator.validate(body.inputs, body.parameters))
        validator.close()
        client.input_lengths = {r.inputs: r.input_length for r in requests}
        outcomes = [
            Outcome(i, job.max_new_tokens, r.input_length)
            for i, (job, r) in enumerate(zip(jobs, requests, strict=True))
        ]

        report = Report(len(jobs), threads, budgets)
        shard = psutil.Process(pid)
        client.prefill_s.clear()
        client.decode_s.clear()
        client.steps.clear()
        cpu0, t0 = cpu_seconds(shard), time.perf_counter()
        tokens = await asyncio.gather(*(_run_one(backend.infer, r, o) for r, o in zip(requests, outcomes, strict=True)))
        report.wall_s = time.perf_counter() - t0
        report.shard_cpu_s = cpu_seconds(shard) - cpu0
    finally:
        await backend.close()
    report.generated_tokens = sum(tokens)
    report.throughput_tok_s = report.generated_tokens / report.wall_s
    report.prefills, report.prefill_s = len(client.prefill_s), sum(client.prefill_s)
    report.decode_steps = len(client.decode_s)
    report.decode_step_p50_ms = statistics.median(client.decode_s) * 1e3 if client.decode_s else 0.0
    report.outcomes = outcomes
    report.steps = client.steps
    return report


def default_threads() -> int:
    """What a launcher-started shard on this machine runs with: OMP_NUM_THREADS if set, else torch's default."""
    return torch.get_num_threads()


def measure(
    model_dir: Path, jobs: list[Job], budgets: Budgets, threads: int, dtype: str = "float32"
) -> tuple[Report, Ceiling]:
    """Start one shard (`dtype`, `threads` threads), run W1 through it, stop it; then time the run's steps'
    projections on this CPU for its ceiling."""
    uds = f"/tmp/textgen-w1-{os.getpid()}"
    proc = start_shard(model_dir, uds, threads, dtype=dtype)
    try:
        report = asyncio.run(drive(f"{uds}-0", proc.pid, model_dir, jobs, budgets, threads))
    finally:
        stop(proc)
    ceiling = Ceiling(model_dir, getattr(torch, dtype), threads)
    ceiling.time_steps(report.steps)
    report.ceiling_s = ceiling.seconds(report.steps)
    report.ceiling_tok_s = report.generated_tokens / report.ceiling_s
    report.ceiling_fraction = report.ceiling_s / report.wall_s
    return report, ceiling


def summary(r: Report) -> str:
    return (
        f"shard-only W1: {r.requests} requests, {r.threads} threads, prefill budget "
        f"{r.budgets.max_batch_prefill_tokens}, batch total {r.budgets.max_batch_total_tokens}\n"
        f"generated tokens {r.generated_tokens} in {r.wall_s:.2f} s: {r.throughput_tok_s:.1f} tok/s\n"
        f"prefill total {r.prefill_s:.2f} s ({r.prefills} prefills), decode steps {r.decode_steps}, "
        f"median decode step {r.decode_step_p50_ms:.1f} ms, shard CPU {r.shard_cpu_s:.1f} s\n"
        f"projections' FLOP ceiling: {r.ceiling_s:.2f} s of products, {r.ceiling_tok_s:.1f} tok/s; "
        f"this run reached {r.ceiling_fraction:.1%} of it"
    )
