"""The request queue: decides *what* runs next, within token budgets, in strict FIFO order.

`Queue.next_batch(min_size, max_size, prefill_token_budget, token_budget)` follows TGI v3's queue for
shards without a block allocator:
- padded shards (Info.requires_padding): the prefill costs (n + 1) * longest prompt, since the shard pads
  every row to the longest; decode tokens add up every max_new_tokens;
- other shards: prompts and (window-capped) max_new_tokens are each rounded up to the shard's block size.
A request that does not fit goes back to the front and closes the batch (no skipping ahead); requests whose
consumer went away are dropped when reached. `BatchBudget` holds that arithmetic over plain numbers. Pure
logic, no I/O: the batching loop awaits nothing here.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace

from textgen_pb import generate_pb2

from . import metrics
from .types import InferError, StreamEvent, TokenSink, ValidRequest

tracer = trace.get_tracer("textgen_router")


class Channel:
    """Unbounded single-consumer channel from the batching loop to one request's stream.

    A leaner asyncio.Queue: put_nowait is an append plus, when the consumer sleeps, one wake-up.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[StreamEvent | InferError] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: StreamEvent | InferError) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> StreamEvent | InferError:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


@dataclass(eq=False)
class Entry:
    """One request's life in the router: queued, then batched, until its stream ends or is dropped.

    `events` receives the StreamEvents of the request, or an InferError that ends it; `sink`, when set, takes
    the IntermediateEvents first (see types.TokenSink); `dropped` is set by the consumer's side when it stops
    listening, and makes the queue and batching loop let go of it.
    """

    request: ValidRequest
    queue_time: float = field(default_factory=time.monotonic)
    events: Channel = field(default_factory=Channel)
    sink: TokenSink | None = None
    parent: otel_context.Context | None = None
    id: int = -1
    batch_time: float | None = None
    dropped: bool = False
    pb: generate_pb2.Request | None = None
    span: trace.Span | None = None

    def finish_span(self) -> None:
        if self.span is not None:
            self.span.end()
            self.span = None


def request_pb(request_id: int, request: ValidRequest) -> generate_pb2.Request:
    """The gRPC Request the shards receive for a validated request (text chunk + stringified inputs)."""
    p, s = request.parameters, request.stopping_parameters
    return generate_pb2.Request(
        id=request_id,
        inputs=request.inputs,
        input_chunks=generate_pb2.Input(chunks=[generate_pb2.InputChunk(text=request.inputs)]),
        truncate=request.truncate,
        add_special_tokens=request.add_special_tokens,
        parameters=generate_pb2.NextTokenChooserParameters(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            typical_p=p.typical_p,
            do_sample=p.do_sample,
            seed=p.seed,
            repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty,
            watermark=p.watermark,
            grammar=p.grammar,
            grammar_type=p.grammar_type,
        ),
        stopping_parameters=generate_pb2.StoppingCriteriaParameters(
            max_new_tokens=s.max_new_tokens,
            stop_sequences=s.stop_sequences,
            ignore_eos_token=s.ignore_eos_token,
        ),
        prefill_logprobs=request.decoder_input_details,
        top_n_tokens=request.top_n_tokens,
        adapter_id=request.adapter_id,
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class BatchBudget:
    """The token accounting of one batch being filled (TGI v3's rules, see the module docstring).

    Pure arithmetic over plain numbers: `admit` says whether one more request fits and, if so, counts it.
    """

    requires_padding: bool
    block_size: int
    window_size: int | None
    speculate: int
    prefill_token_budget: int
    token_budget: int
    size: int = 0
    max_input_length: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def admit(self, input_length: int, max_new_tokens: int) -> bool:
        """Count a request of `input_length` prompt tokens and `max_new_tokens` if the batch can take it."""
        max_input_length = self.max_input_length
        if self.requires_padding:
            # The shard pads every row to the longest prompt: padding costs tokens too.
            max_input_length = max(max_input_length, input_length)
            prefill = (self.size + 1) * max_input_length
            decode = self.decode_tokens + max_new_tokens
        else:
            prefill = self.prefill_tokens + _round_up(input_length, self.block_size)
            if self.window_size is not None:
                max_new_tokens = min(max(0, self.window_size - input_length), max_new_tokens)
            decode = self.decode_tokens + _round_up(max_new_tokens, self.block_size)
        if prefill > self.prefill_token_budget or prefill + decode + self.speculate > self.token_budget:
            return False
        self.size += 1
        self.max_input_length, self.prefill_tokens, self.decode_tokens = max_input_length, prefill, decode
        return True

    @property
    def max_tokens(self) -> int:
        """The prefill plus decode tokens reserved by the admitted requests (the gRPC Batch.max_tokens)."""
        return self.prefill_tokens + self.decode_tokens


class Queue:
    """FIFO of Entries; ids increase per appended request, batch ids per created batch."""

    def __init__(
        self, requires_padding: bool, block_size: int = 1, window_size: int | None = None, speculate: int = 0
    ) -> None:
        self.requires_padding = requires_padding
        self.block_size = max(1, block_size)
        self.window_size = window_size
        self.speculate = speculate
        self.entries: deque[Entry] = deque()
        self.next_id = 0
        self.next_batch_id = 0

    @classmethod
    def for_shards(cls, info: generate_pb2.InfoResponse) -> Queue:
        """The queue for shards that answered Info with `info` (padding, block size, window, speculation)."""
        window_size = info.window_size if info.HasField("window_size") else None
        return cls(info.requires_padding, info.block_size, window_size, info.speculate)

    def __len__(self) -> int:
        return len(self.entries)

    def append(self, entry: Entry) -> None:
        """Give the entry its request id (the gRPC Request.id) and queue it."""
        entry.id = self.next_id
        self.next_id += 1
        entry.pb = request_pb(entry.id, entry.request)
        entry.span = tracer.start_span("queued", context=entry.parent)
        self.entries.append(entry)
        metrics.QUEUE_SIZE.set(len(self.entries))

    def next_batch(
        self, min_size: int | None, max_size: int | None, prefill_token_budget: int, token_budget: int
    ) -> tuple[dict[int, Entry], generate_pb2.Batch] | None:
        """The next batch that fits the budgets, as (entries by request id, gRPC Batch), or None.

        None when the queue is empty, a budget or max_size is 0, or fewer than `min_size` requests fit
        (those then stay queued in order). `Batch.max_tokens` is the prefill plus decode tokens reserved.
        """
        if prefill_token_budget <= 0 or token_budget <= 0 or max_size == 0 or not self.entries:
            return None
        if min_size is not None and len(self.entries) < min_size:
            return None
        budget = BatchBudget(
            self.requires_padding,
            self.block_size,
            self.window_size,
            self.speculate,
            _round_up(prefill_token_budget, self.block_size),
            token_budget,
        )
        batch = self._take(budget, max_size)
        if not batch or (min_size is not None and len(batch) < min_size):
            self.entries.extendleft(reversed(batch))
            metrics.QUEUE_SIZE.set(len(self.entries))
            return None
        return {e.id: e for e in batch}, self._start(batch, budget.max_tokens)

    def _take(self, budget: BatchBudget, max_size: int | None) -> list[Entry]:
        """Pop entries in order while `budget` admits them (at most `max_size`), dropping abandoned ones."""
        batch: list[Entry] = []
        while self.entries:
            entry = self.entries.popleft()
            if entry.dropped:
                metrics.REQUEST_FAILURE.labels("dropped").inc()
                entry.finish_span()
                continue
            request = entry.request
            if not budget.admit(request.input_length, request.stopping_parameters.max_new_tokens):
                self.entries.appendleft(entry)
                break
            batch.append(entry)
            if max_size is not None and len(batch) == max_size:
                break
        return batch

    def _start(self, batch: list[Entry], max_tokens: int) -> generate_pb2.Batch:
        """Mark `batch`'s entries as running (time, tracing span) and make their gRPC Batch."""
        now = time.monotonic()
        requests: list[generate_pb2.Request] = []
        for entry in batch:
            entry.batch_time = now
            entry.finish_span()
            entry.span = tracer.start_span("infer", context=entry.parent)
            assert entry.pb is not None  # set by append
            requests.append(entry.pb)
        pb = generate_pb2.Batch(id=self.next_batch_id, requests=requests, size=len(batch), max_tokens=max_tokens)
        self.next_batch_id += 1
        metrics.QUEUE_SIZE.set(len(self.entries))
        metrics.BATCH_NEXT_SIZE.observe(len(batch))
        return pb
