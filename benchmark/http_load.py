"""W1 HTTP load: a fixed, seeded workload against a running server, or against servers this script starts.

W1 = 64 requests, prompts of 32-256 tokens, 64-128 new tokens, sent all at once (burst) or at a Poisson rate.
Reports throughput (generated tokens/s), time to first token and inter-token latency (p50/p99), and writes a
PNG plot. With --compare it starts textgen (launcher) and `transformers serve` on the same model one after the
other in this process tree and prints the ratio (`transformers serve` needs the `bench` extra:
pip install -e ".[bench]"); with --routes it runs W1 through /generate_stream and /v1/chat/completions on
one textgen server (the OpenAI layer's overhead; `chat_json` adds `response_format: json_object` to every
request, the cost of guided generation). With --shard-baseline it then runs shard_w1.py (the same
workload straight into one shard over gRPC, no router) and reports e2e / shard-only throughput (issue 3:
>= 0.9). The launcher gets --max-input-tokens, --max-total-tokens, --max-batch-prefill-tokens and
--max-batch-total-tokens (default: sized so every request fits one padded prefill) and the shard-only run
schedules under the same budgets; --threads sets OMP_NUM_THREADS for the shard of both runs.

    python benchmark/http_load.py --model models/small-llama-v1 --compare
    python benchmark/http_load.py --model models/small-llama-v1 --routes generate,chat
    python benchmark/http_load.py --model models/small-llama-v1 --routes chat,chat_json
    python benchmark/http_load.py --model models/small-llama-v1 --shard-baseline
    python benchmark/http_load.py --model models/small-llama-v1-cycling --speculate 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from textgen_benchmark.servers import DECODE, Launcher, Server, growth, scrape
from textgen_benchmark.sse_client import sse_events
from textgen_benchmark.stats import Latency
from textgen_benchmark.w1 import Budgets, Job, make_workload, request_body, workload_budgets
from textgen_common.ports import free_port


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def _is_token_event(route: str, payload: dict) -> bool:
    if route == "generate":
        return "token" in payload and not payload["token"].get("special", False)
    choices = payload.get("choices") or []
    return bool(choices and (choices[0].get("delta") or {}).get("content"))


async def _one(url: str, route: str, job: Job, t0: float, model: str) -> Result:
    await asyncio.sleep(max(0.0, t0 + job.send_at - time.perf_counter()))
    path, body = request_body(route, job, model)
    address = urlsplit(url)
    if address.hostname is None or address.port is None:
        raise ValueError(f"{url}: a server URL needs a host and a port")
    res, start = Result(), time.perf_counter()
    last = start
    try:
        async with contextlib.aclosing(sse_events(address.hostname, address.port, path, body)) as events:
            async for now, data in events:
                if data == b"[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    res.error = str(payload["error"])
                    break
                if _is_token_event(route, payload):
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.gaps.append(now - last)
                    last = now
                    res.tokens += 1
    except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as err:
        res.error = repr(err)
    return res


async def run_load(url: str, route: str, jobs: list[Job], model: str = "tgi") -> dict:
    """W1 against `url`; `model` is the chat `model` field (textgen serves "tgi", transformers serve a path)."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one(url, route, j, t0, model) for j in jobs))
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    gaps = [g for r in results for g in r.gaps]
    ttft_ms = Latency.of([t * 1e3 for t in ttfts])
    itl_ms = Latency.of([g * 1e3 for g in gaps])
    return {
        "route": route,
        "requests": len(jobs),
        "errors": sum(r.error is not None for r in results),
        "first_error": next((r.error for r in results if r.error), None),
        "generated_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall,
        "ttft_p50_ms": ttft_ms.p50,
        "ttft_p99_ms": ttft_ms.p99,
        "itl_p50_ms": itl_ms.p50,
        "itl_p99_ms": itl_ms.p99,
        "_ttfts": ttfts,
        "_gaps": gaps,
    }


def dtype_args(dtype: str | None) -> list[str]:
    """`--dtype` for the launcher and `transformers serve` alike; none leaves each its own default (fp32 here)."""
    return [] if dtype is None else ["--dtype", dtype]


def textgen_server(model: str, budgets: Budgets, env: dict[str, str], dtype: str | None, speculate: int) -> Server:
    args = ["--max-concurrent-requests", "256", *budgets.launcher_args(), *dtype_args(dtype)]
    if speculate:
        args += ["--speculate", str(speculate)]
    return Launcher("textgen", model, args, env)


def step_figures(m0: dict[str, float], m1: dict[str, float], router_cpu: float, client_cpu: float) -> dict:
    """Per decode step between scrapes `m0` and `m1`: the router's CPU seconds `router_cpu`, and where an e2e
    step goes: the shard's own forward vs the router's step as it sees it, and the CPU this load client took
    from the same cores (`client_cpu`; a real client runs on another machine). Milliseconds, NaN without steps.
    """

    grown = growth(m0, m1)

    def delta(name: str) -> float:
        return grown.get(name + DECODE, 0.0)

    steps = delta("tgi_batch_inference_count")

    def per_step(seconds: float) -> float:
        return seconds / steps * 1e3 if steps else float("nan")

    return {
        "decode_steps": steps,
        "router_cpu_ms_per_decode_step": per_step(router_cpu),
        "forward_ms_per_decode_step": per_step(delta("tgi_batch_forward_duration_sum")),
        "step_ms_per_decode_step": per_step(delta("tgi_batch_inference_duration_sum")),
        "client_cpu_ms_per_decode_step": per_step(client_cpu),
    }


def measure_textgen(
    model: str,
    routes: list[str],
    jobs: list[Job],
    budgets: Budgets,
    env: dict[str, str],
    dtype: str | None,
    speculate: int = 0,
) -> list[dict]:
    server, out = textgen_server(model, budgets, env, dtype, speculate), []
    try:
        for route in routes:
            m0, cpu0, client0 = scrape(server.url), server.cpu_seconds("textgen-router"), time.process_time()
            r = asyncio.run(run_load(server.url, route, jobs))
            client = time.process_time() - client0
            cpu = server.cpu_seconds("textgen-router") - cpu0
            r["server"] = "textgen"
            r.update(step_figures(m0, scrape(server.url), cpu, client))
            out.append(r)
    finally:
        server.stop()
    return out


def measure_transformers(model: str, jobs: list[Job], dtype: str | None) -> dict:
    port = free_port()
    argv = ["transformers", "serve", model, "--port", str(port), "--host", "127.0.0.1", *dtype_args(dtype)]
    server = Server("transformers", argv, port, "/health")
    try:
        r = asyncio.run(run_load(server.url, "chat", jobs, model))
    finally:
        server.stop()
    r["server"] = "transformers serve"
    return r


def measure_shard_only(model: str, jobs: list[Job], budgets: Budgets, threads: int, dtype: str | None) -> dict:
    """shard_w1.py's run (W1 over gRPC into one shard, no router process) as a row of this script's results."""
    from textgen_benchmark import baseline  # imports torch: only paid when the baseline is asked for

    report, ceiling = baseline.measure(Path(model), jobs, budgets, threads, dtype or "float32")
    print(f"projections' least times (fastest path, GFLOP/s):\n{ceiling.rates()}", file=sys.stderr)
    return {
        "server": "textgen shard-only",
        "route": "grpc",
        "requests": report.requests,
        "errors": 0,
        "first_error": None,
        "generated_tokens": report.generated_tokens,
        "wall_s": report.wall_s,
        "throughput_tok_s": report.throughput_tok_s,
        "decode_steps": report.decode_steps,
        "decode_step_p50_ms": report.decode_step_p50_ms,
        "prefill_s": report.prefill_s,
        "shard_cpu_s": report.shard_cpu_s,
        "ceiling_tok_s": report.ceiling_tok_s,
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in (r for r in results if "_ttfts" in r):  # the shard-only row has no per-token timings
        label = f"{r['server']} {r['route']}"
        a.hist([t * 1e3 for t in r["_ttfts"]], bins=20, alpha=0.5, label=label)
        b.hist([g * 1e3 for g in r["_gaps"]], bins=40, alpha=0.5, label=label)
    a.set(title="time to first token", xlabel="ms", ylabel="requests")
    b.set(title="inter-token latency", xlabel="ms", ylabel="tokens")
    a.legend(), b.legend()
    fig.tight_layout()
    fig.savefig(path)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (also the tokenizer)")
    p.add_argument("--url", help="a running textgen server; default: start one with textgen-launcher")
    p.add_argument(
        "--routes", default="generate", help="comma list of generate, chat, chat_json (chat + JSON response_format)"
    )
    p.add_argument("--compare", action="store_true", help="also run W1 against `transformers serve`")
    p.add_argument("--arrival", choices=["burst", "poisson"], default="burst")
    p.add_argument("--rate", type=float, default=4.0, help="requests/s for --arrival poisson")
    p.add_argument("-n", "--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="benchmark/results/w1.png")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--shard-baseline",
        action="store_true",
        help="then run shard_w1.py (W1 straight into one shard) and report e2e / shard-only",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="OMP_NUM_THREADS of the shard in both runs (default: this environment's; with "
        "--shard-baseline always set, to this environment's or torch's default)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16"),
        help="--dtype of every server measured (default: each one's own, float32 on a CPU)",
    )
    p.add_argument("--speculate", type=int, default=0, help="the launcher's --speculate (n-gram speculation)")
    Budgets.add_arguments(p)
    return p.parse_args()


def measure(args: argparse.Namespace, jobs: list[Job], budgets: Budgets) -> list[dict]:
    """A result row per route on textgen, then the shard-only and `transformers serve` rows when asked."""
    threads = args.threads
    if threads is None and args.shard_baseline:
        from textgen_benchmark import baseline

        # The baseline's shard always gets OMP_NUM_THREADS set (textgen_benchmark.shard.start_shard): give the
        # launcher's shard the same explicit value so the two runs differ in the router alone.
        threads = baseline.default_threads()
    threads_env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    routes = args.routes.split(",")
    if args.url:
        results = [dict(asyncio.run(run_load(args.url, r, jobs)), server="textgen") for r in routes]
    else:
        results = measure_textgen(args.model, routes, jobs, budgets, threads_env, args.dtype, args.speculate)
    if args.shard_baseline:
        shard_only = measure_shard_only(args.model, jobs, budgets, threads, args.dtype)
        for r in results:  # issue 3's target: e2e >= 0.9x shard-only at the same batch
            r["shard_only_ratio"] = r["throughput_tok_s"] / shard_only["throughput_tok_s"]
        results.append(shard_only)
    if args.compare:
        try:
            results.append(measure_transformers(args.model, jobs, args.dtype))
        except RuntimeError as err:  # keep textgen's figures when the peer cannot start
            print(f"peer not measured: {err}", file=sys.stderr)
    return results


def report(args: argparse.Namespace, budgets: Budgets, public: list[dict]) -> None:
    """The results as a markdown table, then per-step figures, errors and throughput ratios."""
    print(
        f"W1: {args.requests} requests, {args.arrival} arrival, seed {args.seed}, dtype {args.dtype or 'default'}; "
        f"{budgets}"
    )
    print(
        "| server | route | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors | router CPU ms/step "
        "| / shard-only |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for r in public:
        print(
            f"| {r['server']} | {r['route']} | {r['throughput_tok_s']:.1f} | {r.get('ttft_p50_ms', nan):.0f} | "
            f"{r.get('ttft_p99_ms', nan):.0f} | {r.get('itl_p50_ms', nan):.1f} | {r.get('itl_p99_ms', nan):.1f} | "
            f"{r['errors']} | {r.get('router_cpu_ms_per_decode_step', nan):.2f} | "
            f"{r.get('shard_only_ratio', nan):.2f} |"
        )
    for r in (r for r in public if "forward_ms_per_decode_step" in r):
        print(
            f"{r['server']} {r['route']}: {r['decode_steps']:.0f} decode steps, mean step "
            f"{r['step_ms_per_decode_step']:.1f} ms (shard forward {r['forward_ms_per_decode_step']:.1f}), "
            f"load client CPU {r['client_cpu_ms_per_decode_step']:.2f} ms/step"
        )
    for r in (r for r in public if "decode_step_p50_ms" in r):
        print(
            f"shard-only: {r['decode_steps']} decode steps, median "
            f"{r['decode_step_p50_ms']:.1f} ms, prefill {r['prefill_s']:.2f} s, "
            f"shard CPU {r['shard_cpu_s']:.1f} s"
        )
    for ceiling in (r["ceiling_tok_s"] for r in public if "ceiling_tok_s" in r):
        # The shard-only run's steps are the schedule every textgen row runs (the same batching loop).
        reached = ", ".join(
            f"{r['server']} {r['route']} {r['throughput_tok_s'] / ceiling:.1%}"
            for r in public
            if "textgen" in r["server"]
        )
        print(f"projections' FLOP ceiling of the shard-only run's steps: {ceiling:.1f} tok/s; reached: {reached}")
    for r in public:
        if r["first_error"]:
            print(f"{r['server']} {r['route']}: first error: {r['first_error']}", file=sys.stderr)
    base = public[0]["throughput_tok_s"]
    for r in public[1:]:
        if not r["throughput_tok_s"]:
            continue
        print(
            f"{public[0]['server']} {public[0]['route']} / {r['server']} {r['route']}: "
            f"{base / r['throughput_tok_s']:.2f}x"
        )
    print(f"plot: {args.plot}", file=sys.stderr)


def main() -> None:
    args = parse_args()
    jobs = make_workload(args.model, args.requests, args.seed, args.arrival, args.rate)
    budgets = workload_budgets(args.model, jobs, args)
    results = measure(args, jobs, budgets)
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.plot)
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    if args.json:
        print(json.dumps(public, indent=2))
    else:
        report(args, budgets, public)


if __name__ == "__main__":
    main()
