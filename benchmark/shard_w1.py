"""W1 straight into one shard over gRPC: the shard-only baseline of the end-to-end HTTP run (issue 3).

The same 64 seeded requests as http_load.py (burst arrival) are validated by the router's own Validator (so
the shard receives exactly the Requests an HTTP /generate_stream call with {"max_new_tokens": N} becomes:
greedy, no stop sequences, EOS honoured, truncate = max_input_tokens) and scheduled by the router's own
Queue (TGI's padded rule: a chunk of n rows costs n * longest prompt against --max-batch-prefill-tokens, and
its prefill plus decode tokens must fit what the running batch leaves of --max-batch-total-tokens). No
router process, no HTTP: after the router's Warmup, this loop Prefills the first chunk, then before every
Decode prefills the next chunk that fits and decodes [running, new] together (the shard concatenates), and
filters finished requests out after every step (FilterBatch, or ClearCache when none is left), as the
router does. Unlike the router it never waits for `waiting_served_ratio`: a chunk joins as soon as it fits.
The default budgets (http_load.workload_budgets) hold the whole workload, so all requests prefill at once.

Throughput is defined as in http_load: generated non-special tokens / wall time from the first Prefill
sent to the last token received. The shard gets OMP_NUM_THREADS as the launcher's shard would: the value of
this environment, else torch's default for this machine.

Usage: python benchmark/shard_w1.py [--model-dir DIR] [-n 64] [--seed 0] [--max-batch-prefill-tokens N]
       [--max-batch-total-tokens N] [--max-input-tokens N] [--max-total-tokens N] [--threads T] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch
from http_load import Budgets, Job, make_workload, request_body, workload_budgets
from shard_decode import DTYPES, cpu_seconds, small_model, start_shard, stop


@dataclass
class Outcome:
    """One request's end: `generated_tokens` and `finish_reason` as the shard's GeneratedText reports them."""

    id: int
    max_new_tokens: int
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
    outcomes: list[Outcome] = field(default_factory=list)


async def drive(socket: str, pid: int, model_dir: Path, jobs: list[Job], budgets: Budgets, threads: int) -> Report:
    """Warm the shard as the router does, then run every job to its end; timings around the gRPC calls."""
    from textgen_pb import generate_pb2
    from textgen_router.backend import warmup_batch
    from textgen_router.batching import FINISH_REASONS, keep_requests
    from textgen_router.queue import Entry, Queue
    from textgen_router.schemas import GenerateRequest
    from textgen_router.shard_client import ShardedClient, StepResult
    from textgen_router.validation import Limits, Validator, load_tokenizer

    client = await ShardedClient.connect(socket)  # ServiceDiscovery
    try:
        await client.clear_cache(None)
        info = await client.info()
        _, max_input, max_total = await client.warmup(
            warmup_batch(budgets.max_input_tokens, budgets.max_batch_prefill_tokens, budgets.max_total_tokens, None),
            budgets.max_input_tokens,
            budgets.max_batch_prefill_tokens,
            budgets.max_total_tokens,
        )
        # The launcher's defaults for the limits W1 does not touch.
        validator = Validator(load_tokenizer(model_dir), Limits(2, 4, 5, max_input, max_total), workers=2)
        queue = Queue(
            info.requires_padding,
            info.block_size,
            info.window_size if info.HasField("window_size") else None,
            info.speculate,
        )
        outcomes: dict[int, Outcome] = {}
        for job in jobs:
            body = GenerateRequest.model_validate(request_body("generate", job, "tgi")[1])
            entry = Entry(await validator.validate(body.inputs, body.parameters))
            queue.append(entry)
            outcomes[entry.id] = Outcome(entry.id, job.max_new_tokens)
        validator.close()

        report = Report(len(jobs), threads, budgets)
        shard = psutil.Process(pid)
        steps: list[float] = []

        def record(result: StepResult, alive: set[int]) -> None:
            for g in result.generations:
                report.generated_tokens += sum(not s for s in g.tokens.is_special)
                if g.HasField("generated_text"):
                    out = outcomes[g.request_id]
                    out.generated_tokens = g.generated_text.generated_tokens
                    out.finish_reason = FINISH_REASONS[g.generated_text.finish_reason]
                    alive.discard(g.request_id)

        async def prefill(token_budget: int) -> tuple[generate_pb2.CachedBatch | None, set[int]]:
            nxt = queue.next_batch(None, None, budgets.max_batch_prefill_tokens, token_budget)
            if nxt is None:
                return None, set()
            entries, batch = nxt
            start = time.perf_counter()
            result = await client.prefill(batch)
            report.prefill_s += time.perf_counter() - start
            report.prefills += 1
            alive = set(entries)
            record(result, alive)
            return await keep_requests(client, result.batch, alive), alive

        cpu0, t0 = cpu_seconds(shard), time.perf_counter()
        cached, running = await prefill(budgets.max_batch_total_tokens)
        while cached is not None or len(queue):
            batches = [] if cached is None else [cached]
            used = 0 if cached is None else cached.max_tokens
            new, joined = await prefill(max(0, budgets.max_batch_total_tokens - used))
            running |= joined
            if new is not None:
                batches.append(new)
            if not batches:
                if not joined:  # nothing runs, yet the next request alone exceeds a budget
                    raise RuntimeError("a request does not fit --max-batch-prefill/total-tokens")
                continue  # the joiners all ended at their prefill
            start = time.perf_counter()
            result = await client.decode(batches)
            steps.append(time.perf_counter() - start)
            record(result, running)
            cached = await keep_requests(client, result.batch, running)
        report.wall_s = time.perf_counter() - t0
        report.shard_cpu_s = cpu_seconds(shard) - cpu0
    finally:
        await client.close()
    report.throughput_tok_s = report.generated_tokens / report.wall_s
    report.decode_steps = len(steps)
    report.decode_step_p50_ms = statistics.median(steps) * 1e3 if steps else 0.0
    report.outcomes = list(outcomes.values())
    return report


def default_threads() -> int:
    """What a launcher-started shard on this machine runs with: OMP_NUM_THREADS if set, else torch's default."""
    return torch.get_num_threads()


def measure(model_dir: Path, jobs: list[Job], budgets: Budgets, threads: int, dtype: str = "float32") -> Report:
    """Start one shard (`dtype`, `threads` threads), run W1 through it, stop it."""
    uds = f"/tmp/textgen-w1-{os.getpid()}"
    proc = start_shard(model_dir, uds, threads, dtype=dtype)
    try:
        return asyncio.run(drive(f"{uds}-0", proc.pid, model_dir, jobs, budgets, threads))
    finally:
        stop(proc)


def summary(r: Report) -> str:
    return (
        f"shard-only W1: {r.requests} requests, {r.threads} threads, prefill budget "
        f"{r.budgets.max_batch_prefill_tokens}, batch total {r.budgets.max_batch_total_tokens}\n"
        f"generated tokens {r.generated_tokens} in {r.wall_s:.2f} s: {r.throughput_tok_s:.1f} tok/s\n"
        f"prefill total {r.prefill_s:.2f} s ({r.prefills} prefills), decode steps {r.decode_steps}, "
        f"median decode step {r.decode_step_p50_ms:.1f} ms, shard CPU {r.shard_cpu_s:.1f} s"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="a built model (default: build/cached small Llama)")
    p.add_argument("-n", "--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="shard OMP threads (default: as the launcher's)")
    p.add_argument("--json", type=Path, help="also write the report as JSON here (with every request's end)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the shard's --dtype")
    Budgets.add_arguments(p)
    args = p.parse_args(argv)
    model_dir = args.model_dir or small_model()
    jobs = make_workload(str(model_dir), args.requests, args.seed, "burst", 0.0)
    budgets = workload_budgets(str(model_dir), jobs, args)
    report = measure(model_dir, jobs, budgets, args.threads or default_threads(), args.dtype)
    print(summary(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    unfinished = [o.id for o in report.outcomes if o.finish_reason is None]
    if unfinished:
        sys.exit(f"requests without an end: {unfinished}")


if __name__ == "__main__":
    main()
