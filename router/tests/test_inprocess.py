"""The router run inside the test process (a thread with its own event loop) on a real loopback port and a
real shard: OpenTelemetry spans seen through an in-memory exporter, and /health across a shard failure."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from testing.shards import spawn_shards
from textgen_common.ports import free_port
from textgen_router import main as router_main
from textgen_router.args import parse_args
from textgen_router.tracing import setup_tracing

pytestmark = pytest.mark.timeout(240)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class InProcessRouter(contextlib.AbstractContextManager):
    """`textgen_router.main.start` + one uvicorn server, in a thread; stopped and closed on exit."""

    def __init__(self, argv: list[str]) -> None:
        self.args = parse_args(argv)
        self.base_url = f"http://127.0.0.1:{self.args.port}"
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        try:
            router = await router_main.start(self.args)
        except BaseException as err:  # reported to the test thread by __enter__
            self._error = err
            self._ready.set()
            return
        try:
            self._server = router_main.server(router.app, "127.0.0.1", self.args.port)
            self._ready.set()
            await self._server.serve()
        finally:
            await router.close()

    def __enter__(self) -> InProcessRouter:
        self._thread.start()
        if not self._ready.wait(120) or self._error is not None:
            raise RuntimeError(f"in-process router failed to start: {self._error!r}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(self.base_url + "/info", timeout=2)
                return self
            time.sleep(0.1)
        raise TimeoutError("in-process router not listening")

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(30)


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    spans = InMemorySpanExporter()
    setup_tracing(None, "textgen-test-router", exporter=spans)
    return spans


# The same KV pool for the shard and its replacement (the router keeps the blocks warmup sized: a pool sized
# from free memory again could be smaller).
POOL = {"TEXTGEN_KV_CACHE_TOKENS": "65536"}


@pytest.fixture(scope="module")
def shard_and_router(tiny_llama: Path, exporter: InMemorySpanExporter) -> Iterator[tuple[Any, InProcessRouter]]:
    shard = spawn_shards(tiny_llama, env=POOL)
    try:
        argv = [
            "--master-shard-uds-path",
            shard.socket,
            "--tokenizer-name",
            str(tiny_llama),
            "--port",
            str(free_port()),
            "--max-input-tokens",
            "32",
            "--max-total-tokens",
            "64",
        ]
        with InProcessRouter(argv) as router:
            yield shard, router
    finally:
        shard.stop()


def test_request_and_validation_spans_follow_traceparent(
    shard_and_router: tuple[Any, InProcessRouter], exporter: InMemorySpanExporter
) -> None:
    _, router = shard_and_router
    exporter.clear()
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    response = httpx.post(
        router.base_url + "/generate",
        headers={"traceparent": traceparent},
        timeout=60,
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
    )
    assert response.status_code == 200
    spans = {span.name: span for span in exporter.get_finished_spans()}
    generate, validate = spans["generate"], spans["validate"]
    assert format(generate.context.trace_id, "032x") == TRACE_ID
    assert format(generate.parent.span_id, "016x") == PARENT_SPAN_ID
    assert validate.parent.span_id == generate.context.span_id
    assert generate.resource.attributes["service.name"] == "textgen-test-router"
    assert "inference_time" in generate.attributes

    exporter.clear()
    streamed = httpx.post(
        router.base_url + "/generate_stream", timeout=60, json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    )
    assert streamed.text.count("data:") == 2
    spans = {span.name: span for span in exporter.get_finished_spans()}
    # The stream's body runs under its request span: validation (inside the body) is its child.
    assert spans["validate"].parent.span_id == spans["generate_stream"].context.span_id
    # Without a traceparent each request starts its own trace.
    assert {s.context.trace_id for s in exporter.get_finished_spans() if s.name == "generate_stream"} != {
        int(TRACE_ID, 16)
    }


def test_health_after_a_shard_failure_and_recovery(
    shard_and_router: tuple[Any, InProcessRouter], tiny_llama: Path
) -> None:
    shard, router = shard_and_router
    base = router.base_url
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    shard.stop()
    failed = httpx.post(base + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert failed.status_code == 424
    assert failed.json()["error_type"] == "generation"
    assert failed.json()["error"].startswith("Request failed during generation: ")
    unhealthy = httpx.get(base + "/health", timeout=30)
    assert unhealthy.status_code == 503
    assert unhealthy.json() == {"error": "unhealthy", "error_type": "healthcheck"}
    # A new shard on the same socket: the next check's liveness prefill passes and health comes back.
    replacement = spawn_shards(tiny_llama, uds_path=shard.uds_path, env=POOL)
    try:
        deadline = time.monotonic() + 60
        status = 503
        while time.monotonic() < deadline and status != 200:
            status = httpx.get(base + "/health", timeout=30).status_code
            time.sleep(0.2)
        assert status == 200
        ok = httpx.post(base + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
        assert ok.status_code == 200
    finally:
        replacement.stop()
