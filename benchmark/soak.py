"""Soak: the real launcher on a local model, driven for a fixed time by twice --max-concurrent-requests clients.

Three phases against one `textgen-launcher` (one shard, loopback only), each bounded in time:

1. idle: `--probes` small requests one after another (POST /generate, 5 tokens): their p50 latency;
2. max-size load: two clients send `--huge-bytes` prompts (1.9 MB: just under the default payload limit) to
   /generate and /tokenize for `--max-size-seconds`, and the small request is timed again until the last of
   them has finished: p50 under load and its ratio to idle;
3. soak: 2 x `--max-concurrent-requests` clients for `--duration` seconds, each looping over greedy requests
   with random prompts (32-256 tokens) and max_new_tokens (1..`--max-new-tokens`), /generate or
   /generate_stream, a tenth of them streams that the client drops after the first event; one more client
   sends a hostile request every `--hostile-every` seconds (bad JSON, temperature 1e-300, a `--huge-bytes`
   prompt, a lone surrogate, JSON nested 1,000 deep) and records the status each got.

Counted per soak request: completed; 429 (the status, or the `overloaded` error event that ends a streaming
answer, as TGI sends it); lost (neither a response nor an error: the connection closed or timed out before a
status line, or a 200 whose body or event stream ends before its final message); wrong length (a completed
greedy request that did not stop on EOS or a stop sequence and whose generated token count differs from
max_new_tokens, or whose reported and received counts disagree); 5xx; 424; other 4xx; other error events
inside a 200 stream; dropped streams (lost and 5xx include the hostile requests'). The router's and the
shard's RSS are sampled over all phases (psutil). Targets (issue 24): 0 lost, 0 wrong, 0 5xx, RSS flat after
warm-up, small-request latency under max-size load <= 2x idle.

    python benchmark/soak.py [--duration 60] [--max-concurrent-requests 16] [--json soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from http_load import make_workload

from textgen_benchmark.servers import Launcher
from textgen_benchmark.stats import Latency
from textgen_server.builder import build_test_model

FIRST_EVENT = re.compile(rb"data:[^\n]*\n\n")
SMALL = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 5}}).encode()
MAX_INPUT_TOKENS = 300  # above the longest prompt make_workload builds (256 tokens)


def hostile_payloads(huge_bytes: int) -> dict[str, bytes]:
    """The hostile /generate bodies by name; `huge_prompt` is also the max-size phase's request."""
    return {
        "bad_json": b'{"inputs": "x", "parameters": {',
        "temperature_1e-300": b'{"inputs": "x", "parameters": {"do_sample": true, "temperature": 1e-300}}',
        "huge_prompt": json.dumps({"inputs": "soak " * (huge_bytes // 5)}).encode(),
        "lone_surrogate": b'{"inputs": "\\ud800"}',
        "deep_nesting": b'{"inputs": "x", "parameters": {"x": ' + b"[" * 1000 + b"]" * 1000 + b"}}",
    }


@dataclass
class Reply:
    """One HTTP exchange as the client saw it: status None when no status line arrived."""

    status: int | None
    body: bytes = b""
    complete: bool = False


async def exchange(port: int, path: str, payload: bytes, timeout: float, drop_after_event: bool = False) -> Reply:
    """POST `payload` (connection: close) and read the answer to EOF, or only to its first SSE event when
    `drop_after_event` (then hang up). Bounded by `timeout`; a reset or a timeout before the status line
    gives status None."""
    raw = b""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(
                    b"POST %s HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s" % (path.encode(), len(payload), payload)
                )
                while chunk := await reader.read(65536):
                    raw += chunk
                    if drop_after_event and FIRST_EVENT.search(raw.partition(b"\r\n\r\n")[2]):
                        break
            finally:
                writer.close()
    except (TimeoutError, OSError):
        pass
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return Reply(None)
    status = int(head.split(b" ", 2)[1])
    headers = head.lower()
    if b"transfer-encoding: chunked" in headers:
        body, complete = dechunk(body)
    else:
        length = next((int(h[15:]) for h in headers.split(b"\r\n") if h.startswith(b"content-length:")), len(body))
        complete = len(body) == length
    return Reply(status, body, complete)


def dechunk(data: bytes) -> tuple[bytes, bool]:
    """The payload of a chunked body, and whether its terminating zero-size chunk arrived."""
    out: list[bytes] = []
    pos = 0
    while (end := data.find(b"\r\n", pos)) >= 0:
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out), True
        out.append(data[end + 2 : end + 2 + size])
        pos = end + 4 + size
    return b"".join(out), False


@dataclass
class Counts:
    """Outcomes of the soak's requests (see the module docstring); `record` files one reply."""

    completed: int = 0
    rejected_429: int = 0
    lost: int = 0
    wrong_length: int = 0
    server_5xx: int = 0
    failed_424: int = 0
    other_4xx: int = 0
    dropped_streams: int = 0
    # error_type -> count, for error events inside a 200 stream other than "overloaded" (counted as 429s)
    stream_errors: dict[str, int] = field(default_factory=dict)
    hostile: dict[str, dict[str, int]] = field(default_factory=dict)

    def record(self, reply: Reply, stream: bool, dropped: bool, max_new_tokens: int) -> str:
        """Count one reply of a greedy request; returns the outcome's name ("rejected_429", ...)."""
        outcome = _outcome(reply, stream, dropped, max_new_tokens)
        if outcome.startswith("stream_error:"):
            error_type = outcome.split(":", 1)[1]
            self.stream_errors[error_type] = self.stream_errors.get(error_type, 0) + 1
        elif outcome == "wrong_length":
            self.completed += 1
            self.wrong_length += 1
        else:
            setattr(self, outcome, getattr(self, outcome) + 1)
        return outcome


def _outcome(reply: Reply, stream: bool, dropped: bool, max_new_tokens: int) -> str:
    if reply.status is None:
        return "lost"
    if reply.status != 200:
        return {429: "rejected_429", 424: "failed_424"}.get(
            reply.status, "server_5xx" if reply.status >= 500 else "other_4xx"
        )
    try:
        if not (reply.complete or dropped):
            raise ValueError("cut short")
        if stream:
            events = [line[5:] for line in reply.body.split(b"\n") if line.startswith(b"data:")]
            # A dropped stream was cut by the client after its first event: that is the one to look at.
            last = json.loads(events[0] if dropped else events[-1])
            if "error" in last:
                # TGI's streaming routes report errors, a full queue included, as an event in a 200 answer.
                error_type = last.get("error_type", "unknown")
                return "rejected_429" if error_type == "overloaded" else f"stream_error:{error_type}"
            if dropped:
                return "dropped_streams"
            details, received = last["details"], len(events)
        else:
            details = json.loads(reply.body)["details"]
            received = len(details["tokens"])
        finish_reason, generated = details["finish_reason"], details["generated_tokens"]
    except (ValueError, KeyError, IndexError, TypeError):
        # An answer without its final message (details) is as good as none.
        return "lost"
    stopped = finish_reason in ("eos_token", "stop_sequence")
    if received != generated or (not stopped and received != max_new_tokens):
        return "wrong_length"
    return "completed"


def start(model: Path, max_concurrent_requests: int, max_new_tokens: int) -> Launcher:
    """`textgen-launcher` on `model` (one shard) with the soak's token and concurrency limits."""
    args = ["--max-input-tokens", str(MAX_INPUT_TOKENS), "--max-total-tokens", str(MAX_INPUT_TOKENS + max_new_tokens)]
    args += ["--max-concurrent-requests", str(max_concurrent_requests)]
    return Launcher("soak", str(model), args, {})


@dataclass
class Soak:
    launcher: Launcher
    args: argparse.Namespace
    counts: Counts = field(default_factory=Counts)
    rss: list[dict[str, float | str]] = field(default_factory=list)
    phase: str = "idle"
    hostile: dict[str, bytes] = field(init=False)
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.hostile = hostile_payloads(self.args.huge_bytes)

    async def sample_rss(self) -> None:
        """Every `--sample-every` seconds, until cancelled or a process is gone (the report then shows where)."""
        while True:
            try:
                self.rss.append(
                    {
                        "t_s": round(time.monotonic() - self.t0, 1),
                        "phase": self.phase,
                        "router_mib": self.launcher.router.memory_info().rss / 2**20,
                        "shard_mib": sum(p.memory_info().rss for p in self.launcher.shards) / 2**20,
                    }
                )
            except psutil.Error:
                return
            await asyncio.sleep(self.args.sample_every)

    async def probe(self, keep_going: Callable[[int], bool]) -> list[float]:
        """Milliseconds of small requests sent one after another while `keep_going(done so far)`."""
        times: list[float] = []
        while keep_going(len(times)):
            start = time.perf_counter()
            reply = await exchange(self.launcher.port, "/generate", SMALL, self.args.request_timeout)
            if reply.status == 200:
                times.append((time.perf_counter() - start) * 1e3)
            await asyncio.sleep(0.05)
        return times

    async def max_size_client(self, path: str, until: float) -> None:
        while time.monotonic() < until:
            await exchange(self.launcher.port, path, self.hostile["huge_prompt"], self.args.request_timeout)

    async def client(self, rng: random.Random, prompts: list[str], until: float) -> None:
        while time.monotonic() < until:
            max_new_tokens = rng.randint(1, self.args.max_new_tokens)
            parameters = {"max_new_tokens": max_new_tokens, "details": True}
            payload = json.dumps({"inputs": rng.choice(prompts), "parameters": parameters}).encode()
            drop = rng.random() < 0.1
            stream = drop or rng.random() < 0.5
            path = "/generate_stream" if stream else "/generate"
            reply = await exchange(self.launcher.port, path, payload, self.args.request_timeout, drop)
            if self.counts.record(reply, stream, drop, max_new_tokens) == "rejected_429":
                # A client backs off (~10 retries/s each): without it the rejected half of the clients spin on
                # the cores the server shares, and the run measures mostly the 429 path.
                await asyncio.sleep(rng.uniform(0.05, 0.15))

    async def hostile_client(self, until: float) -> None:
        kinds = list(self.hostile)
        while time.monotonic() < until:
            kind = kinds[0]
            kinds.append(kinds.pop(0))
            # Retried while the queue is full (bounded): a 429 says nothing about how the input is handled.
            retry_until = time.monotonic() + self.args.hostile_every
            reply = Reply(429)
            while reply.status == 429 and time.monotonic() < retry_until:
                reply = await exchange(self.launcher.port, "/generate", self.hostile[kind], self.args.request_timeout)
                await asyncio.sleep(0.01)
            seen = self.counts.hostile.setdefault(kind, {})
            status = str(reply.status) if reply.status is not None else "lost"
            seen[status] = seen.get(status, 0) + 1
            # A bad input may get a 4xx, never a 5xx or no answer: those count with everyone's.
            if reply.status is None or reply.status >= 500:
                self.counts.record(reply, False, False, 0)
            await asyncio.sleep(self.args.hostile_every)

    async def run(self, prompts: list[str]) -> dict:
        sampler = asyncio.create_task(self.sample_rss())
        try:
            idle = await self.probe(lambda done: done < self.args.probes)
            self.phase = "max-size"
            until = time.monotonic() + self.args.max_size_seconds
            loaders = [asyncio.create_task(self.max_size_client(p, until)) for p in ("/generate", "/tokenize")]
            # Timed for as long as the load lasts: its requests in flight at `until` finish first.
            loaded = await self.probe(lambda done: time.monotonic() < until or not all(t.done() for t in loaders))
            await asyncio.gather(*loaders)
            self.phase = "soak"
            until = time.monotonic() + self.args.duration
            rng = random.Random(self.args.seed)
            clients = [
                self.client(random.Random(rng.random()), prompts, until)
                for _ in range(2 * self.args.max_concurrent_requests)
            ]
            await asyncio.gather(*clients, self.hostile_client(until))
            self.phase = "after"
            await asyncio.sleep(self.args.sample_every)
        finally:
            sampler.cancel()
        idle_p50, loaded_p50 = Latency.of(idle).p50, Latency.of(loaded).p50
        return {
            "config": {k: v for k, v in vars(self.args).items() if k != "json"},
            "counts": asdict(self.counts),
            "rss": self.rss,
            "latency": {
                "idle_p50_ms": idle_p50,
                "max_size_load_p50_ms": loaded_p50,
                "ratio": loaded_p50 / idle_p50,
                "idle_n": len(idle),
                "max_size_load_n": len(loaded),
            },
        }


def print_report(report: dict) -> None:
    config, c, lat = report["config"], report["counts"], report["latency"]
    print(
        f"soak {config['duration']:.0f} s, {2 * config['max_concurrent_requests']} clients "
        f"(2 x --max-concurrent-requests {config['max_concurrent_requests']})"
    )
    print(
        f"completed {c['completed']}  429 {c['rejected_429']}  lost {c['lost']}  wrong-length {c['wrong_length']}  "
        f"5xx {c['server_5xx']}  424 {c['failed_424']}  other 4xx {c['other_4xx']}  "
        f"stream errors {sum(c['stream_errors'].values())} {c['stream_errors'] or ''}  "
        f"dropped streams {c['dropped_streams']}"
    )
    for kind, statuses in c["hostile"].items():
        print(f"hostile {kind}: " + ", ".join(f"{status} x{n}" for status, n in sorted(statuses.items())))
    print("RSS MiB over time (t s phase: router / shard):")
    samples = report["rss"]
    step = max(1, len(samples) // 12)
    for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        print(f"  {s['t_s']:6.1f} {s['phase']:8s} {s['router_mib']:7.1f} / {s['shard_mib']:7.1f}")
    print(
        f"small-request p50: idle {lat['idle_p50_ms']:.1f} ms (n={lat['idle_n']}), under max-size load "
        f"{lat['max_size_load_p50_ms']:.1f} ms (n={lat['max_size_load_n']}), ratio {lat['ratio']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="models/tiny-llama", help="built here when missing")
    parser.add_argument("--size", default="tiny", help="builder size of --model-dir: tiny or small")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the soak phase")
    parser.add_argument("--max-concurrent-requests", type=int, default=16, help="launcher flag; clients = 2x")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="upper end of the random max_new_tokens")
    parser.add_argument("--max-size-seconds", type=float, default=15.0, help="seconds of the max-size phase")
    parser.add_argument(
        "--huge-bytes", type=int, default=1_900_000, help="prompt size of the max-size and huge requests"
    )
    parser.add_argument("--probes", type=int, default=20, help="small requests timed while idle")
    parser.add_argument("--hostile-every", type=float, default=5.0, help="seconds between hostile requests")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="a request past this is lost")
    parser.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args()
    if args.max_concurrent_requests < 3:
        parser.error("--max-concurrent-requests must be >= 3: the max-size phase holds 2 while the probe runs")
    model = build_test_model(args.model_dir, arch="llama", size=args.size)
    prompts = [job.prompt for job in make_workload(str(model), 64, args.seed, "burst", 0.0)]
    launcher = start(model, args.max_concurrent_requests, args.max_new_tokens)
    try:
        report = asyncio.run(Soak(launcher, args).run(prompts))
    finally:
        launcher.stop()
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
