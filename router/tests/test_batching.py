"""Continuous batching through Infer against a real shard process (tiny llama), checked against transformers.

Oracle: greedy tokens of every request equal `model.generate` of the same prompt alone, whatever the batch
it ran in (no cross-talk between rows, joins and filters keep every row's state).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
from inference_harness import collect, prompt, router_config, valid

from textgen_pb import generate_pb2
from textgen_router import metrics
from textgen_router.backend import Backend, connect_backend
from textgen_router.batching import tokens_of
from textgen_router.infer import Infer
from textgen_router.types import (
    EndEvent,
    GenerationError,
    IntermediateEvent,
    OverloadedError,
    StreamEvent,
    ValidRequest,
)

pytestmark = pytest.mark.timeout(180)
# TGI's non-chunking loop (backpressure, waiting_served_ratio), which padded shards get: the padded engine runs
# every model outside the Llama family; test_paged_engine.py drives the chunking loop.
SHARD_ENV = {"USE_FLASH_ATTENTION": "false"}


@pytest.fixture(scope="module")
def backend(shard: Any, run: Any) -> Iterator[Backend]:
    backend = run(connect_backend(shard.socket, router_config(max_batch_prefill_tokens=2048)))
    yield backend
    run(backend.close())


@pytest.fixture
def infer(backend: Backend, run: Any) -> Iterator[Infer]:
    metrics.reset()
    yield backend.infer
    run(idle(backend.infer))
    backend.infer.healthy = True


async def idle(infer: Infer) -> None:
    """Wait (bounded by the caller's timeout) until nothing is queued or running."""
    while infer.batcher.running or len(infer.queue):
        await asyncio.sleep(0.01)


async def until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.005)


def test_64_concurrent_requests_get_their_solo_greedy_tokens(infer: Infer, oracle: Any, run: Any) -> None:
    requests = [valid(oracle, prompt(i), 2 + i % 7) for i in range(64)]

    async def scenario() -> list[list[int]]:
        return await asyncio.gather(*(collect(infer, r) for r in requests))

    results = run(scenario())
    for r, got in zip(requests, results, strict=True):
        assert got == oracle(r.inputs, r.stopping_parameters.max_new_tokens), r.inputs
    # All 64 were queued before the loop woke: one prefill of 64, then decodes filtered as rows finished.
    assert metrics.BATCH_NEXT_SIZE.count() == 1 and metrics.BATCH_INFERENCE_COUNT.value("prefill") == 1
    assert metrics.BATCH_INFERENCE_SUCCESS.value("decode") == 7
    text = metrics.render()[0].decode()
    assert 'tgi_batch_next_size_bucket{le="64"} 1' in text and 'tgi_batch_next_size_bucket{le="63"} 0' in text


def test_new_requests_join_the_running_batch(infer: Infer, oracle: Any, run: Any) -> None:
    long, short = valid(oracle, prompt(1), 30), [valid(oracle, prompt(i), 4) for i in (2, 3)]

    async def scenario() -> tuple[list[int], list[list[int]], float]:
        progress: list[int] = []
        first = asyncio.ensure_future(collect(infer, long, progress))
        await until(lambda: len(progress) >= 3)
        sizes: list[float] = []

        async def joiner(r: ValidRequest) -> list[int]:
            ids = []
            async for event in infer.generate_stream(r):
                ids.append(event.token.id)
                sizes.append(metrics.BATCH_CURRENT_SIZE.value())
            return ids

        joined = await asyncio.gather(*(joiner(r) for r in short))
        assert not first.done()  # the short requests ended while the long one still ran
        return await first, joined, max(sizes)

    got_long, got_short, max_size = run(scenario())
    assert got_long == oracle(long.inputs, 30)
    assert got_short == [oracle(r.inputs, 4) for r in short]
    # Launcher default ratio 0.3: floor(1 * 0.3) = 0 waiting requests suffice, counted as backpressure.
    assert metrics.BATCH_CONCAT.value("backpressure") >= 1 and max_size == 3
    assert metrics.BATCH_INFERENCE_COUNT.value("prefill") >= 2


def test_waiting_request_joins_after_max_waiting_tokens(infer: Infer, oracle: Any, run: Any) -> None:
    batcher = infer.batcher
    saved = batcher.limits
    batcher.limits = dataclasses.replace(saved, waiting_served_ratio=2.0, max_waiting_tokens=5)
    long, late = valid(oracle, prompt(4), 25), valid(oracle, prompt(5), 3)

    async def scenario() -> tuple[list[int], list[int], int]:
        progress: list[int] = []
        first = asyncio.ensure_future(collect(infer, long, progress))
        await until(lambda: len(progress) >= 2)
        submitted_at = metrics.BATCH_INFERENCE_SUCCESS.value("decode")
        late_ids: list[int] = []
        second = asyncio.ensure_future(collect(infer, late, late_ids))
        await until(lambda: late_ids)
        return await first, await second, int(metrics.BATCH_INFERENCE_SUCCESS.value("decode") - submitted_at)

    try:
        got_long, got_late, waited = run(scenario())
    finally:
        batcher.limits = saved
    assert got_long == oracle(long.inputs, 25) and got_late == oracle(late.inputs, 3)
    # One waiting request is fewer than 2.0 x 1 running: it waits out max_waiting_tokens decode steps.
    assert waited >= 3
    assert metrics.BATCH_CONCAT.value("wait_exceeded") == 1 and metrics.BATCH_CONCAT.value("backpressure") == 0


def test_max_batch_size_holds_requests_back(infer: Infer, oracle: Any, run: Any) -> None:
    batcher = infer.batcher
    saved = batcher.limits
    batcher.limits = dataclasses.replace(saved, max_batch_size=2)
    requests = [valid(oracle, prompt(i), n) for i, n in ((13, 3), (14, 8), (15, 3))]

    async def scenario() -> list[list[int]]:
        return await asyncio.gather(*(collect(infer, r) for r in requests))

    try:
        got = run(scenario())
    finally:
        batcher.limits = saved
    assert got == [oracle(r.inputs, r.stopping_parameters.max_new_tokens) for r in requests]
    # Two fit at first; the third joins once the first finished and freed a slot (max_size = 2 - 1).
    assert metrics.BATCH_NEXT_SIZE.count() == 2 and metrics.BATCH_CONCAT.value("backpressure") == 1
    text = metrics.render()[0].decode()
    assert 'tgi_batch_next_size_bucket{le="1"} 1' in text and 'tgi_batch_next_size_bucket{le="2"} 2' in text


def test_dropped_consumer_leaves_the_batch_within_one_step(infer: Infer, oracle: Any, run: Any) -> None:
    kept, dropped = valid(oracle, prompt(6), 40), valid(oracle, prompt(7), 40)

    async def scenario() -> None:
        stream = infer.generate_stream(dropped)
        progress: list[int] = []
        task = asyncio.ensure_future(collect(infer, kept, progress))
        async with contextlib.aclosing(stream):
            for _ in range(3):
                await anext(stream)
        assert len(infer.batcher.running) == 2
        steps = metrics.BATCH_INFERENCE_SUCCESS.value("decode")
        # The step in flight (or the next) sees the drop and filters the shard batch in that same step;
        # the step after it runs with one row.
        await until(lambda: metrics.BATCH_INFERENCE_SUCCESS.value("decode") >= steps + 2)
        assert len(infer.batcher.running) == 1 and metrics.BATCH_CURRENT_SIZE.value() == 1
        assert metrics.REQUEST_FAILURE.value("dropped") == 1
        assert await task == oracle(kept.inputs, 40)

    run(scenario())


def test_sink_takes_tokens_until_it_declines_then_the_stream_gets_the_rest(infer: Infer, oracle: Any, run: Any) -> None:
    """A TokenSink's tokens never reach the stream; once it declines (and keeps declining), every later
    IntermediateEvent comes through the stream, in order, then the EndEvent."""
    request = valid(oracle, prompt(12), 12)
    taken: list[int] = []
    offered: list[int] = []

    def sink(event: IntermediateEvent) -> bool:
        offered.append(event.token.id)
        if len(taken) < 5:
            taken.append(event.token.id)
            return True
        return False

    async def scenario() -> list[StreamEvent]:
        return [event async for event in infer.generate_stream(request, sink)]

    streamed = run(scenario())
    assert [type(e) for e in streamed] == [IntermediateEvent] * 6 + [EndEvent]
    assert taken + [e.token.id for e in streamed] == oracle(request.inputs, 12)
    assert offered == oracle(request.inputs, 12)[:6] + [e.token.id for e in streamed[1:-1]]


def test_prefill_error_fails_only_the_new_requests(infer: Infer, oracle: Any, run: Any) -> None:
    good, bad = valid(oracle, prompt(8), 20), valid(oracle, prompt(9), 0)  # the shard rejects 0 new tokens

    async def scenario() -> list[int]:
        progress: list[int] = []
        task = asyncio.ensure_future(collect(infer, good, progress))
        await until(lambda: len(progress) >= 2)
        with pytest.raises(GenerationError) as err:
            await collect(infer, bad)
        assert str(err.value).startswith("Request failed during generation: Server error: ")
        assert "max_new_tokens" in str(err.value)
        return await task

    assert run(scenario()) == oracle(good.inputs, 20)
    assert metrics.BATCH_INFERENCE_FAILURE.value("prefill") == 1 and metrics.REQUEST_FAILURE.value("generation") == 1
    assert infer.healthy is False
    assert run(infer.health()) is True and infer.healthy is True  # a real liveness prefill passed


def test_decode_error_fails_the_running_batch_and_health_recovers(
    infer: Infer, backend: Backend, oracle: Any, run: Any
) -> None:
    requests = [valid(oracle, prompt(i), 40) for i in (10, 11)]

    async def scenario() -> None:
        progress: list[list[int]] = [[], []]
        tasks = [asyncio.ensure_future(collect(infer, r, p)) for r, p in zip(requests, progress, strict=True)]
        await until(lambda: all(len(p) >= 2 for p in progress))
        await backend.client.clear_cache(None)  # the shard loses the running batch: its next step fails
        for task in tasks:
            with pytest.raises(GenerationError, match="^Request failed during generation: Server error: "):
                await task
        assert infer.batcher.running == {}

    run(scenario())
    assert metrics.BATCH_INFERENCE_FAILURE.value("decode") + metrics.BATCH_INFERENCE_FAILURE.value("prefill") == 1
    assert metrics.REQUEST_FAILURE.value("generation") == 2
    assert infer.healthy is False
    assert run(infer.health()) is True and infer.healthy is True
    again = valid(oracle, prompt(12), 5)
    assert run(collect(infer, again)) == oracle(again.inputs, 5)  # the router serves again


def test_health_when_healthy_uses_the_health_rpc(infer: Infer, run: Any) -> None:
    assert run(infer.health()) is True


def test_permits(infer: Infer) -> None:
    permits = [infer.acquire_permit() for _ in range(128)]
    with pytest.raises(OverloadedError, match="^Model is overloaded$"):
        infer.acquire_permit()
    assert metrics.REQUEST_FAILURE.value("overloaded") == 1
    permits[0].release()
    permits[0].release()  # idempotent: frees one slot only
    with infer.acquire_permit():
        with pytest.raises(OverloadedError):
            infer.acquire_permit()
    for p in permits[1:]:
        p.release()
    assert infer.available_permits == 128


def test_prompt_tokens_without_is_special() -> None:
    # TGI's shards send prefill tokens with an empty is_special; its router reads none there.
    tokens = tokens_of(generate_pb2.Tokens(ids=[1, 2], logprobs=[math.nan, -1.0], texts=["a", "b"]))
    assert [(t.id, t.text, t.special) for t in tokens] == [(1, "a", False), (2, "b", False)]
