"""Max-size inputs against a running router: does a small request still get served meanwhile (issue 24)?

    python benchmark/big_inputs.py --url http://127.0.0.1:3000 --router-pid PID [--tokenizer MODEL_DIR]

Sends 2 concurrent /tokenize of a ~1.9 MB prompt, then 4 concurrent /generate of it (they end in 422 unless
--max-input-tokens allows ~1M tokens), while probing /health and a 5-token /generate in a loop; prints the
probes' worst latencies and the router's RSS. With --tokenizer, first times in this process what a long
input costs (encode, ids and offsets as lists, the /tokenize body) to show what would block an event loop.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import httpx
import psutil

PROMPT = "hello world, " * 146_000  # 1,898,000 characters


def cost_of_a_long_input(model_dir: str) -> None:
    from textgen_router.tokenization import encode, token_list
    from textgen_router.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir).encoder
    start = time.perf_counter()
    enc = tokenizer.encode(PROMPT)
    encoded = time.perf_counter()
    ids, offsets = enc.ids, enc.offsets
    listed = time.perf_counter()
    token_list(tokenizer, PROMPT, True)
    body = time.perf_counter() - listed - (listed - start)  # token_list encodes again
    print(
        f"{len(PROMPT):,} chars, {len(ids):,} tokens: encode {encoded - start:.2f} s (GIL held), ids + offsets "
        f"{listed - encoded:.2f} s, /tokenize body ~{body:.2f} s; same ids as the router's: "
        f"{encode(tokenizer, PROMPT, True, None).ids == ids and len(offsets) == len(ids)}"
    )


def probe(url: str, done: threading.Event, rounds: int | None = None) -> tuple[float, float, int]:
    """Worst /health and 5-token /generate latencies, probing until `done` (or for `rounds`)."""
    health, small, n = 0.0, 0.0, 0
    with httpx.Client(base_url=url, timeout=300) as c:
        while not done.is_set() and (rounds is None or n < rounds):
            start = time.monotonic()
            c.get("/health")
            health = max(health, time.monotonic() - start)
            start = time.monotonic()
            c.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}})
            small, n = max(small, time.monotonic() - start), n + 1
    return health, small, n


def scenario(url: str, router: psutil.Process, name: str, path: str, count: int) -> None:
    rss_before = router.memory_info().rss
    results: list[tuple[int, float]] = []

    def send() -> None:
        body: dict[str, Any] = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}
        with httpx.Client(base_url=url, timeout=600) as c:
            start = time.monotonic()
            status = c.post(path, json=body).status_code
            results.append((status, round(time.monotonic() - start, 1)))

    senders = [threading.Thread(target=send) for _ in range(count)]
    for sender in senders:
        sender.start()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: ([s.join() for s in senders], done.set()))
    waiter.start()
    health, small, n = probe(url, done)
    waiter.join()
    print(
        f"{name}: {sorted(results)} (status, s); meanwhile /health max {health:.3f} s, 5-token /generate max "
        f"{small:.3f} s ({n} probes); router RSS {rss_before / 2**20:.0f} -> {router.memory_info().rss / 2**20:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:3000")
    parser.add_argument("--router-pid", type=int, required=True)
    parser.add_argument("--tokenizer", help="a model directory: time the cost of a long input in this process")
    args = parser.parse_args()
    if args.tokenizer:
        cost_of_a_long_input(args.tokenizer)
    router = psutil.Process(args.router_pid)
    health, small, _ = probe(args.url, threading.Event(), rounds=5)
    print(f"idle: /health max {health:.3f} s, 5-token /generate max {small:.3f} s")
    scenario(args.url, router, "2 x /tokenize 1.9 MB", "/tokenize", 2)
    scenario(args.url, router, "4 x /generate 1.9 MB", "/generate", 4)


if __name__ == "__main__":
    main()
