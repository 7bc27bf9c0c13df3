"""Router CPU per decode step: N concurrent streams through a real launcher (one shard + the router).

The tiny llama makes the shard's step short, so the router's own work dominates what is measured. The
driver is a bare asyncio HTTP/1.1 client (no httpx), so it takes as little of the shared CPU as possible.
Per route (/generate_stream and /v1/chat/completions with stream=true) it runs one unmeasured warm-up round,
then `--rounds` rounds of `--streams` concurrent requests of `--max-new-tokens` tokens, and prints:

- router CPU ms / decode step: user+system time of the `textgen-router` process over the rounds, divided by
  the tgi_batch_inference_count{method="decode"} delta (prefills are few and counted in; that is the cost);
- router CPU us / token: the same CPU time per streamed token, which does not depend on how the burst was
  split into prefills (the number of decode steps does); with the kernel's share of it and how often per
  step the router was preempted (involuntary context switches: other load on the box inflates the CPU time
  of the same work, so compare runs with similar counts);
- shard CPU ms / decode step, the same for the `textgen-server serve` process;
- wall ms / decode step, and generated tokens/s;
- critical path ms / decode step: (tgi_batch_inference_duration - tgi_batch_forward_duration) of decode,
  i.e. the time a step spends outside the shard's forward (gRPC, router loop, filtering) as the router sees it.

    python benchmark/router_cpu.py [--streams 64] [--max-new-tokens 64] [--rounds 2] [--routes generate,chat]
    python benchmark/router_cpu.py --model-dir models/small-llama-v1 --size small   # steps as long as W1's
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import psutil

from textgen_benchmark.servers import DECODE, Launcher, growth, scrape
from textgen_server.builder import build_test_model

PROMPT = "The quick brown fox jumps over the lazy dog and keeps running"


def body(route: str, max_new_tokens: int) -> tuple[str, bytes]:
    if route == "generate":
        payload: dict = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens}}
        return "/generate_stream", json.dumps(payload).encode()
    payload = {
        "model": "tgi",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "stream": True,
    }
    return "/v1/chat/completions", json.dumps(payload).encode()


async def one_stream(port: int, path: str, data: bytes) -> int:
    """POST and read the whole SSE answer; the number of `data:` events other than [DONE]."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (path.encode(), len(data), data)
    )
    raw = await reader.read()
    writer.close()
    if b" 200 " not in raw.split(b"\r\n", 1)[0] or b'"error"' in raw:
        raise RuntimeError(f"bad stream: {raw[:300]!r}")
    return raw.count(b"data:") - raw.count(b"data:[DONE]")


async def run_round(port: int, route: str, streams: int, max_new_tokens: int) -> int:
    path, data = body(route, max_new_tokens)
    return sum(await asyncio.gather(*(one_stream(port, path, data) for _ in range(streams))))


def start(model: Path, streams: int) -> Launcher:
    """`textgen-launcher` on the model, admitting `streams` requests per batch."""
    args = ["--max-concurrent-requests", str(4 * streams), "--max-batch-size", str(streams)]
    # One OpenMP thread: the box is shared, and a spinning second thread makes shard steps noise.
    return Launcher("router_cpu", str(model), args, {"OMP_NUM_THREADS": "1"})


def cpu(proc: psutil.Process) -> tuple[float, float, int]:
    """User and system CPU seconds, and involuntary context switches (preemptions) so far."""
    t = proc.cpu_times()
    return t.user, t.system, proc.num_ctx_switches().involuntary


def measure(launcher: Launcher, route: str, streams: int, max_new_tokens: int, rounds: int) -> dict[str, float]:
    asyncio.run(run_round(launcher.port, route, streams, max_new_tokens))  # warm-up: imports, first compiles
    m0, r0, s0, t0 = scrape(launcher.url), cpu(launcher.router), cpu(launcher.shards[0]), time.perf_counter()
    tokens = sum(asyncio.run(run_round(launcher.port, route, streams, max_new_tokens)) for _ in range(rounds))
    wall = time.perf_counter() - t0
    m1, r1, s1 = scrape(launcher.url), cpu(launcher.router), cpu(launcher.shards[0])
    delta = growth(m0, m1)
    router_user, router_sys, router_preempted = (b - a for a, b in zip(r0, r1, strict=True))
    router = router_user + router_sys
    steps = delta["tgi_batch_inference_count" + DECODE]
    outside_forward = (
        delta["tgi_batch_inference_duration_sum" + DECODE] - delta["tgi_batch_forward_duration_sum" + DECODE]
    )
    return {
        "decode_steps": steps,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "wall_ms_per_step": wall / steps * 1e3,
        "router_cpu_ms_per_step": router / steps * 1e3,
        "router_cpu_us_per_token": router / tokens * 1e6,
        "router_sys_share": router_sys / router,
        "router_preemptions_per_step": router_preempted / steps,
        "shard_cpu_ms_per_step": (s1[0] + s1[1] - s0[0] - s0[1]) / steps * 1e3,
        "critical_path_ms_per_step": outside_forward / steps * 1e3,
        "shard_forward_ms_per_step": delta["tgi_batch_forward_duration_sum" + DECODE] / steps * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="models/tiny-llama", help="built here when missing")
    parser.add_argument(
        "--size",
        default="tiny",
        help="the builder size of --model-dir (a model of another size "
        "there is rebuilt): tiny, or small for the W1 model's step times",
    )
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--routes", default="generate,chat")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    model = build_test_model(args.model_dir, arch="llama", size=args.size)
    launcher = start(model, args.streams)
    # The driver shares the box with the router (a real client is elsewhere): as SCHED_BATCH its wake-ups,
    # one per event read, no longer preempt the router, whose CPU time then stops paying for the cache
    # refills. Set after the launcher started, so the measured processes keep the normal policy.
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    results = {}
    try:
        for route in args.routes.split(","):
            results[route] = r = measure(launcher, route, args.streams, args.max_new_tokens, args.rounds)
            print(
                f"{route:9s} steps {r['decode_steps']:5.0f}  tokens/s {r['tokens_per_s']:7.0f}  "
                f"wall {r['wall_ms_per_step']:6.2f} ms/step  router CPU {r['router_cpu_ms_per_step']:6.2f} "
                f"({r['router_cpu_us_per_token']:4.0f} us/token, {r['router_sys_share']:4.0%} sys, "
                f"{r['router_preemptions_per_step']:4.1f} preempted/step)  "
                f"shard CPU {r['shard_cpu_ms_per_step']:5.2f}  (forward {r['shard_forward_ms_per_step']:5.2f})  "
                f"critical path {r['critical_path_ms_per_step']:5.2f} ms/step",
                flush=True,
            )
    finally:
        launcher.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
