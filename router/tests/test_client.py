"""ShardedClient and connect_backend against a real 2-rank tensor-parallel shard group on unix sockets."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any

import pytest
from inference_harness import collect, prompt, router_config, valid
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from textgen_pb import generate_pb2
from textgen_router import metrics
from textgen_router.backend import Backend, StartupError, _check_limits, connect_backend, warmup_batch
from textgen_router.shard_client import ShardedClient, ShardError, _metadata
from textgen_router.types import GenerationError

NUM_SHARD = 2  # every call fans out to two ranks; each answers generations for its own rows only
# The limits as TGI settles them for shards without a KV pool (the padded engine); test_paged_engine.py covers
# paged shards, whose pool sets max_batch_total_tokens.
SHARD_ENV = {"USE_FLASH_ATTENTION": "false"}
pytestmark = pytest.mark.timeout(120)


def connect(shard: Any, **overrides: Any) -> Coroutine[Any, Any, Backend]:
    return connect_backend(shard.socket, router_config(**overrides))


def test_unreachable_socket(run: Any) -> None:
    path = f"/tmp/tg-missing-{os.getpid()}-0"
    with pytest.raises(StartupError) as err:
        run(connect_backend(path, router_config()))
    assert str(err.value).startswith(
        "Unable to connect to the Python model shards: Could not connect to Text Generation server: "
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(max_input_tokens=128, max_total_tokens=128), "`max_input_tokens` must be < `max_total_tokens`"),
        (dict(max_batch_size=0), "`max_batch_size` must be > 0"),
    ],
)
def test_argument_checks_before_connecting(run: Any, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(StartupError, match=f"^Argument validation error: {message}$"):
        run(connect_backend("/tmp/never-reached-0", router_config(**overrides)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(max_batch_prefill_tokens=32),
            "`max_batch_prefill_tokens` must be >= `max_input_tokens`. Given: 32 and 64",
        ),
        (
            dict(max_batch_total_tokens=200),
            "`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: 256 and 200",
        ),
        (
            dict(max_batch_prefill_tokens=64, max_batch_total_tokens=100),
            "`max_total_tokens` must be <= `max_batch_total_tokens`. Given: 128 and 100",
        ),
    ],
)
def test_contradictory_limits_after_warmup(run: Any, shard: Any, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(StartupError) as err:
        run(connect(shard, **overrides))
    assert str(err.value) == f"Argument validation error: {message}"


def test_shards_that_chunk_prefills_take_prompts_longer_than_a_prefill() -> None:
    _check_limits(64, 128, 32, 16000, chunking=True)
    with pytest.raises(StartupError, match="must be >= `max_input_tokens`"):
        _check_limits(64, 128, 32, 16000, chunking=False)


def test_connect_backend_settles_limits(run: Any, shard: Any, oracle: Any) -> None:
    metrics.reset()
    backend = run(connect(shard))
    try:
        # Generations of both ranks are merged: every request gets all its tokens, exactly once.
        requests = [valid(oracle, prompt(i), 5) for i in range(5)]

        async def all_streams() -> list[list[int]]:
            return await asyncio.gather(*(collect(backend.infer, r) for r in requests))

        got = run(all_streams())
        assert got == [oracle(r.inputs, 5) for r in requests]
        assert backend.info.requires_padding and backend.info.device_type == "cpu"
        assert (backend.max_input_tokens, backend.max_total_tokens) == (64, 128)
        # A padded shard reports no supported total: TGI falls back to max(16000, total, prefill).
        assert backend.max_batch_total_tokens == 16000
        assert metrics.BATCH_MAX_TOTAL_TOKENS.value() == 16000
        assert metrics.REQUEST_INPUT_LENGTH.buckets[0] == 0.64 and metrics.REQUEST_GENERATED_TOKENS.buckets[-1] == 128
    finally:
        run(backend.close())


def test_warmup_batch_fills_prefill_budget() -> None:
    batch = warmup_batch(max_input_tokens=30, max_prefill_tokens=70, max_total_tokens=40, max_batch_size=None)
    assert [r.truncate for r in batch.requests] == [30, 30, 10]
    first = batch.requests[0]
    assert [c.WhichOneof("chunk") for c in first.input_chunks.chunks] == ["text", "image"]
    assert first.input_chunks.chunks[0].text == "_test " * 30 and first.stopping_parameters.max_new_tokens == 10
    assert first.prefill_logprobs and first.top_n_tokens == 20 and first.parameters.watermark
    assert len(batch.requests[1].input_chunks.chunks) == 1
    assert warmup_batch(30, 70, None, 2).size == 2
    assert warmup_batch(None, 70, None, None).requests[0].stopping_parameters.max_new_tokens == 1


def test_client_calls(run: Any, shard: Any) -> None:
    async def scenario() -> None:
        client = await ShardedClient.connect(shard.url)
        try:
            assert client.num_shards == 2
            assert (await client.info()).dtype == "torch.float32"
            await client.health()
            await client.clear_cache(None)
            request = generate_pb2.Request(
                id=5,
                inputs="Hello",
                input_chunks=generate_pb2.Input(chunks=[generate_pb2.InputChunk(text="Hello")]),
                truncate=64,
                parameters=generate_pb2.NextTokenChooserParameters(
                    temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0
                ),
                stopping_parameters=generate_pb2.StoppingCriteriaParameters(max_new_tokens=4),
            )
            other = generate_pb2.Request()
            other.CopyFrom(request)
            other.id = 6
            result = await client.prefill(generate_pb2.Batch(id=3, requests=[request, other], size=2, max_tokens=20))
            assert sorted(g.request_id for g in result.generations) == [5, 6]
            assert result.batch is not None and result.batch.id == 3 and result.total_ns > 0
            kept = await client.filter_batch(3, [6])
            assert list(kept.request_ids) == [6]
            step = await client.decode([kept])
            assert [g.request_id for g in step.generations] == [6]
            await client.clear_cache(3)
            with pytest.raises(ShardError) as err:
                await client.decode([kept])  # the batch is gone: the shard's error comes back as ShardError
            assert err.value.message
        finally:
            await client.close()

    run(scenario())


def test_trace_context_is_injected() -> None:
    tracer = TracerProvider().get_tracer("test")
    assert _metadata() is None  # no active span: nothing to propagate
    with trace.use_span(tracer.start_span("request"), end_on_exit=True) as span:
        metadata = dict(_metadata() or ())
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert metadata["traceparent"].split("-")[1] == trace_id


def test_close_ends_pending_streams(run: Any, shard: Any, oracle: Any) -> None:
    async def scenario() -> None:
        backend = await connect(shard)
        progress: list[int] = []
        running = asyncio.ensure_future(collect(backend.infer, valid(oracle, prompt(1), 60), progress))
        while len(progress) < 2:
            await asyncio.sleep(0.005)
        await backend.close()
        with pytest.raises(GenerationError, match="the router is shutting down"):
            await running

    run(scenario())
