"""A long prompt arriving while many streams decode: do the streams stall while it is prefilled?

One real launcher on the small Llama with `--max-batch-prefill-tokens 256` (and `--max-input-tokens` /
`--max-total-tokens` that admit the long prompt). It is first warmed by one request as long as the long prompt
(other random text, so a prefix cache cannot serve the measured one). Then `--streams` (32) greedy
/generate_stream requests with short random prompts (8-24 tokens) start decoding, enough new tokens each to
outlast the test. Once every stream has `SETTLE` tokens, a quiet window of `--quiet-steps` tokens per stream
passes; then the long prompt (1,800 tokens) is sent, and the streams run on until each has one token past
the long prompt's first token, when they are cut off (the router drops them).

Reported per run, from every stream's token arrival times (textgen_benchmark.itl_window): the inter-token
latency p50 / p99 / max over the window from the long prompt's send until its first token (the engine steps
it spanned, the router's prefill calls in it from /metrics), the same over the quiet window before it, and the
long prompt's time to first token. Target (issue 21, chunked prefill): p99 <= 2x p50 in the window; one
unchunked prefill of the long prompt stalls every stream for its whole duration.

An engine that cannot chunk refuses a prefill budget below `--max-input-tokens` at start-up (today's router:
"`max_batch_prefill_tokens` must be >= `max_input_tokens`"): the run is then repeated with the budget raised to
`--max-input-tokens`, and the table says so. `--compare` adds a run with PREFILL_CHUNKING=0.

    python benchmark/long_prompt.py [--model-dir DIR] [--dtype bfloat16[,float32]] [--threads 1] [--compare]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from textgen_benchmark import engine
from textgen_benchmark.itl_window import WindowFigures
from textgen_benchmark.servers import PREFILL, Server, growth, log_path, scrape
from textgen_benchmark.sse_client import Stream, generate_stream
from textgen_benchmark.table import markdown_table
from textgen_benchmark.w1 import random_text

SETTLE = 3  # tokens every stream has before the quiet window opens (their own prefills are behind them)
REFUSED = "must be >= `max_input_tokens`"  # the router's start-up error when it cannot chunk prefills


@dataclass
class Prompts:
    streams: list[str]
    long: str
    warm: str  # as long as `long`, other text
    long_tokens: int  # as the router counts them (BOS included)


def make_prompts(model: Path, streams: int, long_tokens: int, seed: int) -> Prompts:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    short = [random_text(tok, rng, rng.randint(8, 24)) for _ in range(streams)]
    long, warm = random_text(tok, rng, long_tokens), random_text(tok, rng, long_tokens)
    return Prompts(short, long, warm, len(tok(long)["input_ids"]))


def body(prompt: str, max_new_tokens: int) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}


async def until(done: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll `done` every 5 ms; TimeoutError naming `what` past `deadline` (perf_counter seconds)."""
    while not done():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not reached in time (raise --timeout)")
        await asyncio.sleep(0.005)


async def drive(url: str, p: Prompts, args: argparse.Namespace) -> dict:
    """The streams, the quiet window, the long prompt; figures of both windows."""
    deadline = time.perf_counter() + args.timeout
    warm = await generate_stream(url, body(p.warm, 2))
    if warm.error:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    records = [Stream() for _ in p.streams]
    tasks = [
        asyncio.create_task(generate_stream(url, body(s, args.stream_new_tokens), r))
        for s, r in zip(p.streams, records, strict=True)
    ]
    long = Stream()
    try:

        def live() -> list[Stream]:
            return [r for r, t in zip(records, tasks, strict=True) if not t.done()]

        def least() -> int:
            return min((len(r.arrivals) for r in live()), default=1 << 30)

        await until(lambda: least() >= SETTLE, deadline, "every stream decoding")
        quiet_start = time.perf_counter()
        await until(lambda: least() >= SETTLE + args.quiet_steps, deadline, "the quiet window")
        m0 = await asyncio.to_thread(scrape, url)  # in a thread: the loop keeps stamping arrivals meanwhile
        long_task = asyncio.create_task(generate_stream(url, body(p.long, args.long_new_tokens), long))
        await until(lambda: bool(long.arrivals) or long_task.done(), deadline, "the long prompt's first token")
        if not long.arrivals:
            raise RuntimeError(f"the long prompt failed: {long.error}")
        first = long.arrivals[0]
        m1 = await asyncio.to_thread(scrape, url)
        await until(lambda: all(r.arrivals[-1] > first for r in live()), deadline, "a token past the window")
        await long_task
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    arrivals = [r.arrivals for r in records]
    return {
        "window": asdict(WindowFigures.of(arrivals, long.sent, first)),
        "quiet": asdict(WindowFigures.of(arrivals, quiet_start, long.sent)),
        "long_ttft_ms": (long.ttft or 0.0) * 1e3,
        "prefill_calls_in_window": growth(m0, m1).get("tgi_batch_inference_count" + PREFILL, 0.0),
        "streams_done_before_window_end": sum(bool(r.arrivals) and r.arrivals[-1] <= first for r in records),
        "stream_errors": [r.error for r in records if r.error],
    }


def start(args: argparse.Namespace, model: Path, p: Prompts, dtype: str, chunking: str | None) -> tuple[Server, int]:
    """The launcher for one run and the prefill budget it runs under: `--max-batch-prefill-tokens`, or
    `--max-input-tokens` where the router refuses a smaller one (an engine without chunking)."""
    context = engine.context_length(model)
    flags = ["--max-input-tokens", str(p.long_tokens), "--max-total-tokens", str(context)]
    flags += ["--max-batch-total-tokens", str((args.streams + 2) * context)]
    flags += ["--max-concurrent-requests", str(args.streams + 8)]
    env = {} if chunking is None else {"PREFILL_CHUNKING": chunking}
    name = f"long-prompt-{chunking or 'default'}"
    for budget in (args.max_batch_prefill_tokens, p.long_tokens):
        try:
            budget_flags = [*flags, "--max-batch-prefill-tokens", str(budget)]
            return engine.start(name, model, dtype, args.threads, budget_flags, env), budget
        except RuntimeError:
            if budget == p.long_tokens or REFUSED not in Path(log_path(name)).read_text():
                raise
            print(f"the router refused --max-batch-prefill-tokens {budget} (no chunking): running with {p.long_tokens}")
    raise AssertionError("unreachable")


def measure(args: argparse.Namespace, model: Path, p: Prompts, dtype: str, chunking: str | None) -> dict:
    server, budget = start(args, model, p, dtype, chunking)
    try:
        figures = asyncio.run(drive(server.url, p, args))
    finally:
        server.stop()
    return {"dtype": dtype, "prefill_chunking": chunking or "default", "prefill_budget": budget, **figures}


def report(args: argparse.Namespace, p: Prompts, runs: list[dict]) -> str:
    head = (
        f"Long prompt during decode: {args.streams} streams, long prompt {p.long_tokens} tokens, "
        f"--max-batch-prefill-tokens {args.max_batch_prefill_tokens}, quiet window {args.quiet_steps} steps, "
        f"shard threads {args.threads}"
    )
    header = ["dtype", "PREFILL_CHUNKING", "prefill budget", "window s", "steps", "prefills", "ITL p50 ms"]
    header += ["ITL p99 ms", "ITL max ms", "p99/p50", "quiet p50 ms", "quiet p99 ms", "p99/quiet p50"]
    rows = []
    for r in runs:
        w, q = WindowFigures(**r["window"]), WindowFigures(**r["quiet"])
        rows.append(
            [r["dtype"], r["prefill_chunking"], str(r["prefill_budget"]), f"{w.seconds:.2f}", f"{w.steps:.0f}"]
            + [f"{r['prefill_calls_in_window']:.0f}", f"{w.p50_ms:.1f}", f"{w.p99_ms:.1f}", f"{w.max_ms:.1f}"]
            + [f"{w.p99_over_p50:.2f}", f"{q.p50_ms:.1f}", f"{q.p99_ms:.1f}", f"{w.p99_ms / q.p50_ms:.2f}"]
        )
    lines = [head, "", markdown_table(header, rows), ""]
    lines.append(
        "target: window p99/p50 <= 2. A window of one or two steps (one unchunked prefill) has the stall as its"
        " p50 too: p99/quiet p50 compares the window's p99 with an undisturbed step's gap"
    )
    for r in runs:
        if r["streams_done_before_window_end"] or r["stream_errors"]:
            lines.append(
                f"{r['dtype']} {r['prefill_chunking']}: {r['streams_done_before_window_end']} streams ended before "
                f"the window did (raise --stream-new-tokens); errors: {r['stream_errors'][:1]}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine.add_arguments(ap, timeout=300.0)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-new-tokens", type=int, default=200, help="max_new_tokens of each stream")
    ap.add_argument("--long-tokens", type=int, default=1800, help="the long prompt's length")
    ap.add_argument("--long-new-tokens", type=int, default=8)
    ap.add_argument("--quiet-steps", type=int, default=20, help="tokens per stream in the quiet window")
    ap.add_argument("--max-batch-prefill-tokens", type=int, default=256, help="launcher flag")
    ap.add_argument("--compare", action="store_true", help="also run with PREFILL_CHUNKING=0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engine.stop_on_sigterm()
    model = engine.model_dir(args)
    p = make_prompts(model, args.streams, args.long_tokens, args.seed)
    if p.long_tokens + args.long_new_tokens > engine.context_length(model):
        ap.error(f"the long prompt ({p.long_tokens} tokens) + {args.long_new_tokens} new exceed the context")
    chunking = [None, "0"] if args.compare else [None]
    runs = [measure(args, model, p, d, c) for d in engine.dtypes(args) for c in chunking]
    print(report(args, p, runs))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
