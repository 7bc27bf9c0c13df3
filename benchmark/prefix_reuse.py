"""W2, prefix reuse: requests sharing one long system prompt, through the real launcher with the prefix cache
on and off.

n requests (64) = one system prompt of ~1,500 tokens + a blank line + a question of its own (20-60 tokens),
all random vocabulary text from a seed; 64 new tokens each, greedy, through /generate_stream. The launcher is
started twice, one after the other on the same model and flags: PREFIX_CACHING=1, then PREFIX_CACHING=0 (the
same ATTENTION for both: this environment's, else what the launcher resolves from the model). Each is warmed
by one request carrying the system prompt (2 new tokens), then the n requests are sent at once
(`--concurrency` bounds how many are in flight). Per run: time to first streamed token (p50/p99, from each
request's send), throughput (generated tokens / wall time from the first send to the last token), the
router's prefill and decode calls and their forward seconds (/metrics deltas); then cache on vs off (issue
21's targets: TTFT p50 >= 10x lower, throughput >= 3x).

And the prefills' projections (issue 42: the cached prefills' forward time within 1.5x of what their projections
need): the prompt tokens each run computes (every prompt's, less the shared BOS + system prompt when the cache
holds them), spread evenly over the run's prefill calls but at most the prefill budget each (the chunks past it go
on inside Decode calls, whose time is not prefill time), at the least times textgen_benchmark.ceiling measures on
this CPU after the launchers stop; printed as those seconds and the prefill forward time over them. The running
batch's rows that ride along in a prefill are not counted, so the ratio errs high.

TGI's HTTP API has no ignore_eos: the requests honour EOS. The random model rarely chooses it; the table counts
the requests that stopped before 64 tokens (greedy, so the same ones in both runs but for rounding).

    python benchmark/prefix_reuse.py [--model-dir DIR] [--dtype bfloat16[,float32]] [--threads 1] [-n 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from textgen_benchmark import engine
from textgen_benchmark.ceiling import Ceiling, Step
from textgen_benchmark.servers import DECODE, PREFILL, growth, scrape
from textgen_benchmark.sse_client import Stream, generate_stream
from textgen_benchmark.stats import Latency
from textgen_benchmark.table import markdown_table
from textgen_benchmark.w1 import random_text

SEPARATOR = "\n\n"  # the tokenizer never merges across it: every prompt's ids start with the system prompt's


@dataclass
class Workload:
    system: str
    prompts: list[str]
    prompt_tokens: list[int]  # as the router counts them (BOS included)
    shared_tokens: int  # leading ids every prompt has in common with the system prompt alone


def make_workload(model: Path, n: int, system_tokens: int, question: tuple[int, int], seed: int) -> Workload:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    system = random_text(tok, rng, system_tokens)
    prompts = [system + SEPARATOR + random_text(tok, rng, rng.randint(*question)) for _ in range(n)]
    ids = [tok(p)["input_ids"] for p in prompts]
    shared = len(os.path.commonprefix([tok(system)["input_ids"], *ids]))
    return Workload(system, prompts, [len(p) for p in ids], shared)


def body(prompt: str, max_new_tokens: int) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}


async def burst(url: str, prompts: list[str], max_new_tokens: int, concurrency: int, timeout: float) -> list[Stream]:
    """Every prompt at once (at most `concurrency` in flight when > 0); a request past `timeout` seconds from
    the first send is cut off and counted as an error."""
    gate = asyncio.Semaphore(concurrency or len(prompts))
    streams = [Stream() for _ in prompts]

    async def one(prompt: str, record: Stream) -> None:
        async with gate:
            await generate_stream(url, body(prompt, max_new_tokens), record)

    tasks = [asyncio.create_task(one(p, s)) for p, s in zip(prompts, streams, strict=True)]
    _, late = await asyncio.wait(tasks, timeout=timeout)
    for task, record in zip(tasks, streams, strict=True):
        if task in late:
            task.cancel()
            record.error = f"not done after {timeout:.0f} s"
    await asyncio.gather(*tasks, return_exceptions=True)
    return streams


def measure(args: argparse.Namespace, model: Path, w: Workload, dtype: str, caching: str) -> dict:
    """One launcher with PREFIX_CACHING=`caching`: warm-up, then the burst; figures for the table."""
    max_input = max(w.prompt_tokens)
    max_total = max_input + args.max_new_tokens
    batch_total = max(len(w.prompts) * max_total, args.max_batch_prefill_tokens)
    flags = [
        *("--max-input-tokens", str(max_input), "--max-total-tokens", str(max_total)),
        *("--max-batch-prefill-tokens", str(args.max_batch_prefill_tokens)),
        *("--max-batch-total-tokens", str(args.max_batch_total_tokens or batch_total)),
        *("--max-concurrent-requests", str(len(w.prompts) + 16)),
    ]
    server = engine.start(f"prefix-reuse-{caching}", model, dtype, args.threads, flags, {"PREFIX_CACHING": caching})
    try:
        warm = asyncio.run(generate_stream(server.url, body(w.system + SEPARATOR + "warm up", 2)))
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        m0, t0 = scrape(server.url), time.perf_counter()
        streams = asyncio.run(burst(server.url, w.prompts, args.max_new_tokens, args.concurrency, args.timeout))
        m1 = scrape(server.url)
    finally:
        server.stop()
    done = [s for s in streams if s.arrivals]
    wall = max((s.arrivals[-1] for s in done), default=t0) - t0
    tokens = sum(len(s.arrivals) for s in streams)
    ttft = Latency.of([s.ttft * 1e3 for s in streams if s.ttft is not None])
    delta = growth(m0, m1)
    return {
        "dtype": dtype,
        "prefix_caching": caching,
        "requests": len(streams),
        "errors": sum(s.error is not None for s in streams),
        "first_error": next((s.error for s in streams if s.error), None),
        "stopped_early": sum(s.finish_reason not in (None, "length") for s in streams),
        "generated_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall if wall > 0 else float("nan"),
        "ttft_p50_ms": ttft.p50,
        "ttft_p99_ms": ttft.p99,
        "prefill_calls": delta.get("tgi_batch_inference_count" + PREFILL, 0.0),
        "prefill_forward_s": delta.get("tgi_batch_forward_duration_sum" + PREFILL, 0.0),
        "decode_steps": delta.get("tgi_batch_inference_count" + DECODE, 0.0),
        "prefill_tokens": sum(w.prompt_tokens) - (w.shared_tokens * len(w.prompts) if caching == "1" else 0),
    }


def add_projections(args: argparse.Namespace, ceiling: Ceiling, run: dict) -> None:
    """The run's prefill tokens through the projections at this CPU's least times (see the module docstring)."""
    calls = max(int(run["prefill_calls"]), 1)
    step = Step(
        min(round(run["prefill_tokens"] / calls), args.max_batch_prefill_tokens), round(run["requests"] / calls)
    )
    ceiling.time_steps([step])
    seconds = calls * ceiling.step_seconds(step)
    run["prefill_projections_s"] = seconds
    run["prefill_forward_over_projections"] = run["prefill_forward_s"] / seconds


def report(args: argparse.Namespace, w: Workload, runs: list[dict]) -> str:
    head = (
        f"W2 prefix reuse: {len(w.prompts)} requests, prompts {min(w.prompt_tokens)}-{max(w.prompt_tokens)} "
        f"tokens of which {w.shared_tokens} shared (BOS + system prompt), {args.max_new_tokens} new tokens, "
        f"greedy; {'all at once' if not args.concurrency else f'at most {args.concurrency} in flight'}; "
        f"prefill budget {args.max_batch_prefill_tokens}; shard threads {args.threads}"
    )
    header = ["dtype", "PREFIX_CACHING", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "wall s", "tokens", "errors"]
    header += ["stopped early", "prefills", "prefill tokens", "prefill forward s", "projections s", "forward / proj."]
    header += ["decode steps"]
    rows = [
        [r["dtype"], r["prefix_caching"], f"{r['throughput_tok_s']:.1f}", f"{r['ttft_p50_ms']:.0f}"]
        + [f"{r['ttft_p99_ms']:.0f}", f"{r['wall_s']:.1f}", str(r["generated_tokens"]), str(r["errors"])]
        + [str(r["stopped_early"]), f"{r['prefill_calls']:.0f}", str(r["prefill_tokens"])]
        + [f"{r['prefill_forward_s']:.1f}", f"{r['prefill_projections_s']:.2f}"]
        + [f"{r['prefill_forward_over_projections']:.2f}", f"{r['decode_steps']:.0f}"]
        for r in runs
    ]
    lines = [head, "", markdown_table(header, rows), ""]
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        by = {r["prefix_caching"]: r for r in runs if r["dtype"] == dtype}
        if "1" in by and "0" in by:
            on, off = by["1"], by["0"]
            lines.append(
                f"{dtype}: cache on vs off: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x lower "
                f"(target >= 10x), TTFT p99 {off['ttft_p99_ms'] / on['ttft_p99_ms']:.2f}x lower, "
                f"throughput {on['throughput_tok_s'] / off['throughput_tok_s']:.2f}x (target >= 3x)"
            )
    for r in (r for r in runs if r["errors"]):
        lines.append(f"{r['dtype']} PREFIX_CACHING={r['prefix_caching']}: first error: {r['first_error']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine.add_arguments(p, timeout=900.0)
    p.add_argument("-n", "--requests", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=1500, help="length of the shared system prompt")
    p.add_argument("--question-tokens", type=int, nargs=2, default=(20, 60), metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=0, help="requests in flight at most (default 0: all at once)")
    p.add_argument("--caching", default="1,0", help="PREFIX_CACHING values, one launcher each, in this order")
    p.add_argument("--max-batch-prefill-tokens", type=int, default=2048, help="launcher flag (its default here)")
    p.add_argument("--max-batch-total-tokens", type=int, help="launcher flag (default: every request's tokens at once)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    engine.stop_on_sigterm()
    model = engine.model_dir(args)
    w = make_workload(model, args.requests, args.system_tokens, tuple(args.question_tokens), args.seed)
    if max(w.prompt_tokens) + args.max_new_tokens > engine.context_length(model):
        p.error(f"prompts of up to {max(w.prompt_tokens)} tokens + {args.max_new_tokens} new exceed the context")
    runs = [measure(args, model, w, d, c) for d in engine.dtypes(args) for c in args.caching.split(",")]
    import torch

    # Timed once every launcher has stopped; one ceiling a dtype, its times shared by the runs with and without cache.
    ceilings = {d: Ceiling(model, getattr(torch, d), args.threads) for d in engine.dtypes(args)}
    for run in runs:
        add_projections(args, ceilings[run["dtype"]], run)
    print(report(args, w, runs))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
