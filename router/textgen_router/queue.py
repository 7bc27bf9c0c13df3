"""The request queue: decides *what* runs next, within token budgets, in strict FIFO order.

`Queue.next_batch(min_size, max_size, prefill_token_budget, token_budget)` follows TGI v3's queue:
- padded shards (Info.requires_padding): the prefill costs (n + 1) * longest prompt, since the shard pads
  every row to the longest; decode tokens add up every max_new_tokens (`BatchBudget`);
- paged shards (a `BlockAllocator` given): a request is admitted when the allocator has blocks for all its
  tokens; the prefill counts only the prompt tokens past its cached prefix, and with chunking the request
  that overflows the prefill budget takes what is left of it (`chunk_len`) and closes the batch;
- no padding and no allocator: prompts and (window-capped) max_new_tokens are each rounded up to the block
  size (TGI v2's queue; `BatchBudget`).
A request that does not fit goes back to the front and closes the batch (no skipping ahead); requests whose
consumer went away are dropped when reached. Pure logic, no I/O: the batching loop awaits nothing here.
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
from .block_allocator import BlockAllocation, BlockAllocator
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

    `allocation` (paged shards) holds the request's KV blocks from the batch it joins until it leaves the
    router, when whoever lets it go calls `release()`; `prefilled` turns True with its first generation, the
    proof that the shards computed its whole prompt.
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
    allocation: BlockAllocation | None = None
    prefilled: bool = False

    def release(self) -> None:
        """Give back the entry's blocks, if it holds any: its prompt is cached only when prefilled."""
        allocation, self.allocation = self.allocation, None  # cleared first: a failing release is not retried
        if allocation is not None:
            allocation.release(cache_prompt=self.prefilled)

    def finish_span(self) -> None:
        if self.span is not None:
            self.span.end()
            self.span = None


def request_pb(request_id: int, request: ValidRequest) -> generate_pb2.Request:
    """The gRPC Request the shards receive for a validated request: its text, or its text and images, as
    chunks, and the stringified inputs."""
    p, s = request.parameters, request.stopping_parameters
    return generate_pb2.Request(
        id=request_id,
        inputs=request.inputs,
        input_chunks=generate_pb2.Input(chunks=input_chunks(request)),
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
    """FIFO of Entries; ids increase per appended request, batch ids per created batch.

    `allocator` set: the shards are paged and the queue hands out their blocks (see the module docstring);
    `support_chunking`: the shards may prefill a prompt over several steps.
    """

    def __init__(
        self,
        requires_padding: bool,
        block_size: int = 1,
        window_size: int | None = None,
        speculate: int = 0,
        allocator: BlockAllocator | None = None,
        support_chunking: bool = False,
    ) -> None:
        self.requires_padding = requires_padding
        self.block_size = max(1, block_size)
        self.window_size = window_size
        self.speculate = speculate
        self.allocator = allocator
        self.support_chunking = support_chunking
        self.entries: deque[Entry] = deque()
        self.next_id = 0
        self.next_batch_id = 0

    @classmethod
    def for_shards(cls, info: generate_pb2.InfoResponse, max_batch_total_tokens: int) -> Queue:
        """The queue for shards that answered Info with `info`, holding `max_batch_total_tokens` in a batch.

        Shards without padding that report a block size get a block allocator over that many tokens (the
        radix one when they cache prefixes), as TGI v3.
        """
        window_size = info.window_size if info.HasField("window_size") else None
        allocator = None
        if not info.requires_padding and info.block_size > 0:
            allocator = BlockAllocator.for_shards(
                max_batch_total_tokens, info.block_size, info.use_prefix_caching, window_size
            )
        return cls(
            info.requires_padding, info.block_size, window_size, info.speculate, allocator, info.support_chunking
        )

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
        prefill_token_budget = _round_up(prefill_token_budget, self.block_size)
        chunk_len: int | None = None
        if self.allocator is not None:
            batch, max_tokens, chunk_len = self._take_paged(self.allocator, max_size, prefill_token_budget)
        else:
            budget = BatchBudget(
                self.requires_padding,
                self.block_size,
                self.window_size,
                self.speculate,
                prefill_token_budget,
                token_budget,
            )
            batch, max_tokens = self._take(budget, max_size), budget.max_tokens
        if not batch or (min_size is not None and len(batch) < min_size):
            for entry in batch:  # TGI frees them too, and allocates again when they next fit
                entry.release()
            self.entries.extendleft(reversed(batch))
            metrics.QUEUE_SIZE.set(len(self.entries))
            return None
        return {e.id: e for e in batch}, self._start(batch, max_tokens, chunk_len)

    def _pop(self) -> Entry | None:
        """The first entry still wanted, dropping (and counting) the abandoned ones before it."""
        while self.entries:
            entry = self.entries.popleft()
            if not entry.dropped:
                return entry
            metrics.REQUEST_FAILURE.labels("dropped").inc()
            entry.finish_span()
        return None

    def _take(self, budget: BatchBudget, max_size: int | None) -> list[Entry]:
        """Pop entries in order while `budget` admits them (at most `max_size`)."""
        batch: list[Entry] = []
        while (entry := self._pop()) is not None:
            request = entry.request
            if not budget.admit(request.input_length, request.stopping_parameters.max_new_tokens):
                self.entries.appendleft(entry)
                break
            batch.append(entry)
            if max_size is not None and len(batch) == max_size:
                break
        return batch

    def _take_paged(
        self, allocator: BlockAllocator, max_size: int | None, prefill_token_budget: int
    ) -> tuple[list[Entry], int, int | None]:
        """Pop entries in order while the allocator has their blocks and the prefill budget their uncached
        prompt tokens (at most `max_size`).

        Returns the entries (each holding its allocation), the prefill tokens counted (TGI's Batch.max_tokens
        for paged shards: decode tokens are covered by the blocks) and the chunk length of the last entry when
        it was chunked.
        """
        batch: list[Entry] = []
        prefill_tokens = 0
        while (entry := self._pop()) is not None:
            request = entry.request
            tokens = request.input_length + request.stopping_parameters.max_new_tokens + self.speculate - 1
            # Prefill logprobs need every prompt token computed: no lookup, and nothing cached afterwards.
            prompt = None if request.decoder_input_details else request.prefix_key
            allocation = allocator.allocate(tokens, prompt)
            if allocation is None:
                self.entries.appendleft(entry)
                break
            entry.allocation = allocation
            postfix = request.input_length - self._cache_len(entry)
            if prefill_tokens + postfix > prefill_token_budget:
                chunk_len = prefill_token_budget - prefill_tokens
                if self.support_chunking and chunk_len > 0:
                    batch.append(entry)
                    return batch, prefill_tokens, chunk_len
                entry.release()
                self.entries.appendleft(entry)
                break
            prefill_tokens += postfix
            batch.append(entry)
            if max_size is not None and len(batch) == max_size:
                break
        return batch, prefill_tokens, None

    @staticmethod
    def _cache_len(entry: Entry) -> int:
        """The prompt tokens the shards need not compute: the cached prefix, short of the whole prompt (the
        forward needs at least one token to produce the next one)."""
        assert entry.allocation is not None
        return min(entry.allocation.prefix_len, entry.request.input_length - 1)

    def _start(self, batch: list[Entry], max_tokens: int, chunk_len: int | None) -> generate_pb2.Batch:
        """Mark `batch`'s entries as running (time, tracing span) and make their gRPC Batch.

        Paged shards also get each request's blocks, slots and cached prefix length, the batch's largest block
        count, and `chunk_len` on the last request when it was chunked.
        """
        now = time.monotonic()
        requests: list[generate_pb2.Request] = []
        max_blocks = 0
        for entry in batch:
            entry.batch_time = now
            entry.finish_span()
            entry.span = tracer.start_span("infer", context=entry.parent)
            pb = entry.pb
            assert pb is not None  # set by append
            if entry.allocation is not None:
                pb.blocks[:] = entry.allocation.blocks
                pb.slots[:] = entry.allocation.slots
                pb.cache_len = self._cache_len(entry)
                max_blocks = max(max_blocks, len(entry.allocation.blocks))
            requests.append(pb)
        if chunk_len is not None:
            requests[-1].chunk_len = chunk_len
        pb = generate_pb2.Batch(
            id=self.next_batch_id, requests=requests, size=len(batch), max_tokens=max_tokens, max_blocks=max_blocks
        )
        self.next_batch_id += 1
        metrics.QUEUE_SIZE.set(len(self.entries))
        metrics.BATCH_NEXT_SIZE.observe(len(batch))
        return pb


def input_chunks(request: ValidRequest) -> list[generate_pb2.InputChunk]:
    if request.chunks is None:
        return [generate_pb2.InputChunk(text=request.inputs)]
    return [
        generate_pb2.InputChunk(text=chunk)
        if isinstance(chunk, str)
        else generate_pb2.InputChunk(image=generate_pb2.Image(data=chunk.data, mimetype=chunk.mimetype))
        for chunk in request.chunks
    ]
