"""The continuous-batching loop: decides *when* queued requests run, and routes results to their streams.

TGI v3's loop: wait for a request; prefill the largest batch the queue yields; then decode the running batch
step by step. Before each step, waiting requests may join:
- shards without chunking: the queue must yield at least `waiting_served_ratio` x the running batch size
  (backpressure), or anything that fits once `max_waiting_tokens` steps passed without onboarding. The joiners
  are prefilled alone (the running batch pauses one step) and then decoded together with it (a Decode with two
  batches, concatenated by the shards);
- shards that chunk prefills: whatever fits in the prefill budget left by the running batch's next forward
  (`max_batch_prefill_tokens - current_tokens`) joins at once, in a Prefill that carries the running batch
  (`cached_batch`) for the shards to extend; rows still prefilling a prompt get no generation until its last
  chunk is done.
After every Prefill/Decode the generations become their entries' events, and finished or dropped requests are
filtered out of the shard batch in the same step (FilterBatch, or ClearCache when none is left).
The events are delivered only once the next Prefill/Decode is sent (or the loop goes idle): their HTTP work
(JSON, SSE, socket writes) then overlaps the shards' step instead of delaying it. An entry's sink (a stream's
writer, see types.TokenSink) takes its IntermediateEvents right there, in this task; the other events wake the
request's task.
A failing Prefill fails its new requests, and with chunking the running ones it carried too; a failing Decode
fails the whole running batch; either way the shard caches of the failed batches are cleared. A Prefill the
shards refuse for some of its requests only (`ShardError.refused`) fails just those, each with its reason, and
the others are prefilled again.
An entry's first generation marks it prefilled; every entry that leaves (finished, dropped, failed) releases
its KV blocks, caching its prompt only when it was prefilled (see queue.Entry).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Sequence
from typing import NamedTuple

from opentelemetry import trace

from textgen_pb import generate_pb2

from . import metrics
from .config import BatchingLimits
from .queue import Entry, Queue
from .shard_client import ShardedClient, ShardError, StepResult
from .types import EndEvent, GeneratedText, GenerationError, IntermediateEvent, PrefillEvent, StreamEvent, Token

logger = logging.getLogger("textgen_router.batching")
tracer = trace.get_tracer("textgen_router")

FINISH_REASONS = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_EOS_TOKEN: "eos_token",
    generate_pb2.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
}
PREFILL, DECODE = "prefill", "decode"


def tokens_of(t: generate_pb2.Tokens) -> list[Token]:
    """`is_special` may be empty: TGI's shards send prompt tokens without it (and TGI's router reads none there)."""
    special = t.is_special or [False] * len(t.ids)
    return [Token(i, text, lp, sp) for i, text, lp, sp in zip(t.ids, t.texts, t.logprobs, special, strict=True)]


async def keep_requests(
    client: ShardedClient, batch: generate_pb2.CachedBatch | None, request_ids: Collection[int]
) -> generate_pb2.CachedBatch | None:
    """`batch` reduced to `request_ids` on every shard: unchanged when all remain (no call), FilterBatch
    when some do, ClearCache (and None) when none does."""
    if batch is None:
        return None
    if batch.size == len(request_ids):
        return batch
    if not request_ids:
        await client.clear_cache(batch.id)
        return None
    return await client.filter_batch(batch.id, list(request_ids))


class JoinLimits(NamedTuple):
    """`Queue.next_batch`'s arguments for the requests that may join a running batch."""

    min_size: int | None
    max_size: int | None
    prefill_token_budget: int
    token_budget: int


def join_limits(
    cached: generate_pb2.CachedBatch, limits: BatchingLimits, chunking: bool, wait_exceeded: bool
) -> JoinLimits:
    """What may join the running batch `cached` (TGI v3's batching task, see the module docstring).

    With chunking the joiners share the running batch's next forward, so the prefill budget is what that
    forward leaves (`current_tokens`), and sizes do not matter since the budget bounds a step; otherwise a join
    must be worth pausing the running batch for (`min_size`) unless it waited `max_waiting_tokens` steps.
    """
    token_budget = max(0, limits.max_batch_total_tokens - cached.max_tokens)
    if chunking:
        return JoinLimits(None, None, max(0, limits.max_batch_prefill_tokens - cached.current_tokens), token_budget)
    min_size = None if wait_exceeded else math.floor(cached.size * limits.waiting_served_ratio)
    max_size = None if limits.max_batch_size is None else max(0, limits.max_batch_size - cached.size)
    return JoinLimits(min_size, max_size, limits.max_batch_prefill_tokens, token_budget)


class Batcher:
    """Owns the running batch; `run()` is the loop task, `notify()` wakes it after an append.

    `limits` is read at every step: replacing it applies from the next one.
    """

    def __init__(
        self,
        client: ShardedClient,
        queue: Queue,
        limits: BatchingLimits,
    ) -> None:
        self.client = client
        self.queue = queue
        self.limits = limits
        self.running: dict[int, Entry] = {}  # every entry of the running (shard-cached) batch
        self._wakeup = asyncio.Event()
        self._undelivered: list[tuple[Entry, StreamEvent]] = []  # events made since the last shard call was sent

    def notify(self) -> None:
        self._wakeup.set()

    async def run(self) -> None:
        """Loop forever: wait for requests, then prefill/decode until nothing is left running."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            try:
                await self._serve_queue()
            except Exception as err:  # a bug, not a shard error: fail what runs, keep serving the rest
                logger.exception("Batching loop error")
                self.fail_all(f"Server error: {err!r}", queued=False)
                try:
                    await self.client.clear_cache(None)
                except ShardError:
                    logger.exception("Unable to clear the Python model shards cache")
                self.notify()
            finally:
                self._deliver()
                metrics.BATCH_CURRENT_SIZE.set(0)
                metrics.BATCH_CURRENT_MAX_TOKENS.set(0)

    async def _serve_queue(self) -> None:
        while (nxt := self._first_batch()) is not None:
            entries, batch = nxt
            self.running = entries
            cached = await self._prefill(batch, entries)
            waiting_tokens = 1
            while cached is not None:
                cached, joined = await self._step(cached, waiting_tokens >= self.limits.max_waiting_tokens)
                waiting_tokens = 1 if joined else waiting_tokens + 1
            self.running = {}
            metrics.BATCH_CURRENT_SIZE.set(0)
            metrics.BATCH_CURRENT_MAX_TOKENS.set(0)

    def _first_batch(self) -> tuple[dict[int, Entry], generate_pb2.Batch] | None:
        """The batch to start from when nothing runs: the whole of every budget is free."""
        limits = self.limits
        return self.queue.next_batch(
            None, limits.max_batch_size, limits.max_batch_prefill_tokens, limits.max_batch_total_tokens
        )

    async def _step(
        self, cached: generate_pb2.CachedBatch, wait_exceeded: bool
    ) -> tuple[generate_pb2.CachedBatch | None, bool]:
        """Maybe onboard waiting requests, then one Decode of everything running.

        Returns the next cached batch and whether waiting requests were taken from the queue.
        """
        batches = [cached]
        metrics.BATCH_CURRENT_SIZE.set(cached.size)
        metrics.BATCH_CURRENT_MAX_TOKENS.set(cached.max_tokens)
        chunking = self.queue.support_chunking
        join = join_limits(cached, self.limits, chunking, wait_exceeded)
        nxt = self.queue.next_batch(*join)
        if nxt is not None:
            new_entries, new_batch = nxt
            reason = "backpressure" if join.min_size is not None else "chunking" if chunking else "wait_exceeded"
            metrics.BATCH_CONCAT.labels(reason).inc()
            if chunking:
                self.running.update(new_entries)
                new_cached = await self._prefill(new_batch, self.running, cached)
                if new_cached is None:  # every request ended (or the Prefill failed): nothing left to decode
                    return None, True
                batches = [new_cached]
            else:
                try:
                    new_cached = await self._prefill(new_batch, new_entries)
                finally:  # running, so that even a bug in the prefill's handling ends them (fail_all)
                    self.running.update(new_entries)
                if new_cached is not None:
                    batches.append(new_cached)
        return await self._decode(batches, self.running), nxt is not None

    async def _prefill(
        self,
        batch: generate_pb2.Batch,
        entries: dict[int, Entry],
        cached_batch: generate_pb2.CachedBatch | None = None,
    ) -> generate_pb2.CachedBatch | None:
        """Prefill `batch` (extending `cached_batch` on the shards when chunking); `entries` are every request
        of the resulting batch."""
        start = time.monotonic()
        metrics.BATCH_INFERENCE_COUNT.labels(PREFILL).inc()
        batch_ids = [batch.id] if cached_batch is None else [batch.id, cached_batch.id]
        # The new requests' spans only: with chunking, `entries` also holds every running request.
        new = [entries[r.id] for r in batch.requests]
        links = [trace.Link(e.span.get_span_context()) for e in new if e.span is not None]
        with tracer.start_as_current_span("batch", links=links, attributes={"batch_size": len(new)}):
            try:
                result = await self.client.prefill(batch, cached_batch, sent=self._deliver_soon)
            except ShardError as err:
                metrics.BATCH_INFERENCE_FAILURE.labels(PREFILL).inc()
                rest = self._refuse(batch, entries, err.refused)
                if rest is None:
                    await self._fail(batch_ids, entries, err)
                    return None
            else:
                return await self._after(PREFILL, result, entries, batch_ids, start)
        # Every refusal ends an entry, so these retries stop. A refusing shard validates the new requests
        # before it touches `cached_batch`, which it still holds as it was.
        if rest.requests:
            return await self._prefill(rest, entries, cached_batch)
        return cached_batch

    def _refuse(
        self, batch: generate_pb2.Batch, entries: dict[int, Entry], refused: dict[int, str]
    ) -> generate_pb2.Batch | None:
        """End the requests the shards refused, each with its own reason, and return `batch` without them.

        None (nothing ended) when the failure refused no request of `batch` in particular. The refused call
        cached nothing, so the rest keeps the batch id; its `max_tokens` still covers the rest.
        """
        new_ids = {r.id for r in batch.requests}
        if not refused or not refused.keys() <= new_ids:
            return None
        for request_id, reason in refused.items():
            self._end(entries.pop(request_id), f"Server error: {reason}")
        requests = [r for r in batch.requests if r.id not in refused]
        return generate_pb2.Batch(
            id=batch.id,
            requests=requests,
            size=len(requests),
            max_tokens=batch.max_tokens,
            max_blocks=batch.max_blocks,
        )

    async def _decode(
        self, batches: Sequence[generate_pb2.CachedBatch], entries: dict[int, Entry]
    ) -> generate_pb2.CachedBatch | None:
        start = time.monotonic()
        metrics.BATCH_INFERENCE_COUNT.labels(DECODE).inc()
        with tracer.start_as_current_span("batch", attributes={"batch_size": len(entries)}):
            try:
                result = await self.client.decode(batches, sent=self._deliver_soon)
            except ShardError as err:
                await self._fail([b.id for b in batches], entries, err)
                metrics.BATCH_INFERENCE_FAILURE.labels(DECODE).inc()
                return None
            return await self._after(DECODE, result, entries, [b.id for b in batches], start)

    async def _after(
        self, method: str, result: StepResult, entries: dict[int, Entry], batch_ids: list[int], start: float
    ) -> generate_pb2.CachedBatch | None:
        """Route the generations, filter the next batch, record the step's metrics."""
        filter_start = time.monotonic()
        self._send(result.generations, entries)
        try:
            next_batch = await keep_requests(self.client, result.batch, entries)
        except ShardError as err:
            # TGI panics here; failing just this batch keeps the router serving.
            await self._fail(batch_ids + ([result.batch.id] if result.batch else []), entries, err)
            metrics.BATCH_INFERENCE_FAILURE.labels(method).inc()
            return None
        if result.concat_ns is not None:
            metrics.BATCH_CONCAT_DURATION.labels(DECODE).observe(result.concat_ns / 1e9)
        metrics.BATCH_FORWARD_DURATION.labels(method).observe(result.forward_ns / 1e9)
        metrics.BATCH_DECODE_DURATION.labels(method).observe(result.decode_ns / 1e9)
        end = time.monotonic()
        metrics.BATCH_FILTER_DURATION.labels(method).observe(end - filter_start)
        metrics.BATCH_INFERENCE_DURATION.labels(method).observe(end - start)
        metrics.BATCH_INFERENCE_SUCCESS.labels(method).inc()
        return next_batch

    def _deliver_soon(self) -> None:
        # After the shard calls' send tasks, which grpc.aio scheduled already: the sinks' socket writes must
        # not hold the step's request back.
        asyncio.get_running_loop().call_soon(self._deliver)

    def _deliver(self) -> None:
        """Hand the events made since the last shard call to their sinks or streams, in order."""
        for entry, event in self._undelivered:
            sink = entry.sink
            if sink is None or type(event) is not IntermediateEvent or not sink(event):
                entry.events.put_nowait(event)
        self._undelivered.clear()

    def _send(self, generations: Sequence[generate_pb2.Generation], entries: dict[int, Entry]) -> None:
        """Turn each generation into its entry's events (delivered later, see `_deliver`); forget entries that
        ended or were dropped.

        Hot path (once per request per step): every protobuf field access costs, so optional fields are
        only read when the request asked for them.
        """
        skipped_tokens = metrics.REQUEST_SKIPPED_TOKENS.labels()
        put = self._undelivered.append
        for g in generations:
            rid = g.request_id
            entry = entries[rid]
            entry.prefilled = True
            if entry.dropped:
                metrics.REQUEST_FAILURE.labels("dropped").inc()
                entry.finish_span()
                entry.release()
                del entries[rid]
                continue
            request = entry.request
            if request.decoder_input_details and g.HasField("prefill_tokens"):
                put((entry, PrefillEvent(tokens_of(g.prefill_tokens))))
            toks = g.tokens
            ids, texts, logprobs, special = toks.ids, toks.texts, toks.logprobs, toks.is_special
            last = len(ids) - 1
            skipped_tokens.observe(last)  # tokens beyond the first: accepted speculation, as TGI records
            top_tokens = g.top_tokens if request.top_n_tokens else ()
            done = g.HasField("generated_text")
            for i in range(last + 1):
                token = Token(ids[i], texts[i], logprobs[i], special[i])
                top = tokens_of(top_tokens[i]) if i < len(top_tokens) else []
                if done and i == last:
                    gt = g.generated_text
                    put(
                        (
                            entry,
                            EndEvent(
                                token,
                                top,
                                GeneratedText(
                                    gt.text,
                                    gt.generated_tokens,
                                    FINISH_REASONS[gt.finish_reason],
                                    gt.seed if gt.HasField("seed") else None,
                                ),
                                entry.queue_time,
                                entry.batch_time or entry.queue_time,
                            ),
                        )
                    )
                else:
                    put((entry, IntermediateEvent(token, top)))
            if done:
                entry.finish_span()
                entry.release()
                del entries[rid]

    async def _fail(self, batch_ids: list[int], entries: dict[int, Entry], err: ShardError) -> None:
        """Fail every entry of the failed batch(es) and drop their shard caches."""
        self._deliver()  # the events of the step before the failure come first
        for batch_id in batch_ids:
            try:
                await self.client.clear_cache(batch_id)
            except ShardError:
                logger.exception("Unable to clear the cache of failed batch %d", batch_id)
        logger.error("Shard call failed: %s", err.message)
        message = f"Server error: {err.public_message}"
        for entry in entries.values():
            self._end(entry, message)
        entries.clear()

    @staticmethod
    def _end(entry: Entry, message: str) -> None:
        """End one request with GenerationError(message)."""
        error = GenerationError(message)  # one instance per stream: each consumer raises its own
        metrics.REQUEST_FAILURE.labels("generation").inc()
        logger.error("%s", error)
        entry.events.put_nowait(error)
        entry.finish_span()
        entry.release()

    def fail_all(self, message: str, queued: bool = True) -> None:
        """End every running request (and every queued one if `queued`) with GenerationError(message)."""
        self._deliver()
        pending = list(self.running.values())
        self.running = {}
        if queued:
            pending.extend(self.queue.entries)
            self.queue.entries.clear()
            metrics.QUEUE_SIZE.set(0)
        for entry in pending:
            entry.events.put_nowait(GenerationError(message))
            entry.finish_span()
            entry.release()
