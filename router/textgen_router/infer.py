"""Infer: the inference side as the HTTP layer sees it (permits, token streams, health).

Contract with the HTTP layer:
- `acquire_permit()` first, before validation (TGI): a non-blocking slot among `max_concurrent_requests`;
  raises OverloadedError (and counts tgi_request_failure{err="overloaded"}) when none is free. Hold the
  Permit for the whole request or stream, then `release()` it (idempotent) or use it as a context manager.
- `generate_stream(valid_request, sink=None)`: an async iterator of PrefillEvent (only with
  decoder_input_details), IntermediateEvent... (those `sink` did not take, see types.TokenSink), then exactly
  one EndEvent; raises GenerationError if the shards fail. Stopping early (break, `aclose()`, client
  disconnect) drops the request: it leaves the queue or the running batch at the next step. Prefer
  `contextlib.aclosing(...)` so the drop is immediate rather than at garbage collection.
- `await health()`: TGI's /health check; `healthy` is False after a generation error until a check passes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from types import TracebackType

from opentelemetry import context as otel_context

from textgen_pb import generate_pb2

from . import metrics
from .batching import Batcher
from .queue import Entry, Queue
from .shard_client import ShardedClient, ShardError
from .types import EndEvent, InferError, OverloadedError, StreamEvent, TokenSink, ValidRequest

LIVENESS_ID = 2**64 - 1


def liveness_batch() -> generate_pb2.Batch:
    """TGI's model-health probe: one greedy token of "liveness", outside the queue's id space."""
    request = generate_pb2.Request(
        id=LIVENESS_ID,
        inputs="liveness",
        input_chunks=generate_pb2.Input(chunks=[generate_pb2.InputChunk(text="liveness")]),
        truncate=1,
        add_special_tokens=True,
        prefill_logprobs=False,
        parameters=generate_pb2.NextTokenChooserParameters(
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            typical_p=1.0,
            do_sample=False,
            seed=0,
            repetition_penalty=1.0,
            frequency_penalty=0.0,
            watermark=False,
        ),
        stopping_parameters=generate_pb2.StoppingCriteriaParameters(max_new_tokens=1, ignore_eos_token=False),
        top_n_tokens=0,
        blocks=[0],
        slots=[0],
    )
    return generate_pb2.Batch(id=LIVENESS_ID, requests=[request], size=1, max_tokens=2, max_blocks=1)


class Permit(contextlib.AbstractContextManager):
    """One of the `max_concurrent_requests` slots; `release()` may be called any number of times."""

    def __init__(self, infer: Infer) -> None:
        self._infer: Infer | None = infer

    def release(self) -> None:
        if self._infer is not None:
            self._infer.available_permits += 1
            self._infer = None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Infer:
    """Queue + batching task over a ShardedClient. `start()` spawns the loop, `await stop()` ends it."""

    def __init__(self, client: ShardedClient, queue: Queue, batcher: Batcher, max_concurrent_requests: int) -> None:
        self.client = client
        self.queue = queue
        self.batcher = batcher
        self.available_permits = max_concurrent_requests
        self.healthy = True  # warmup already ran a batch through the shards (TGI v3 starts healthy)
        self._task: asyncio.Task[None] | None = None

    def acquire_permit(self) -> Permit:
        if self.available_permits <= 0:
            metrics.REQUEST_FAILURE.labels("overloaded").inc()
            raise OverloadedError()
        self.available_permits -= 1
        return Permit(self)

    async def generate_stream(
        self, request: ValidRequest, sink: TokenSink | None = None
    ) -> AsyncGenerator[StreamEvent, None]:
        """Queue `request` and yield its events as the batching loop produces them (see module docs)."""
        entry = Entry(request, parent=otel_context.get_current(), sink=sink)
        self.queue.append(entry)
        self.batcher.notify()
        finished = False
        try:
            while True:
                event = await entry.events.get()
                if isinstance(event, InferError):
                    finished = True
                    self.healthy = False
                    raise event
                if isinstance(event, EndEvent):
                    finished = True
                    yield event
                    return
                yield event
        finally:
            if not finished:
                entry.dropped = True

    async def health(self) -> bool:
        """Health RPC on every shard while healthy; else a real one-token Prefill (skipping the queue)."""
        try:
            if self.healthy:
                await self.client.health()
            else:
                result = await self.client.prefill(liveness_batch())
                if result.batch is not None:  # the probe asks 1 token, yet never leave it cached
                    await self.client.clear_cache(result.batch.id)
            self.healthy = True
        except ShardError:
            self.healthy = False
        return self.healthy

    def start(self) -> None:
        """Spawn the batching loop task (no-op when it runs already)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.batcher.run(), name="batching-loop")

    async def stop(self) -> None:
        """Cancel the batching loop and end every pending request with an error."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.batcher.fail_all("Server error: the router is shutting down")
