"""Generation helpers shared by every generating route (native and OpenAI-compatible).

- `generate(state, inputs, parameters)` -> `Generation`: one finished sequence (permit, validation, queue).
- `generate_best_of(state, inputs, parameters, best_of)` -> (winner, others).
- `all_or_first_error(runs)`: several sequences of one request, given up at the first error (TGI's
  `try_join_all`).
- `stream(state, inputs, parameters, sink=None)` -> async iterator of (ValidRequest, StreamEvent), without the
  IntermediateEvents `sink` took (types.TokenSink); closing it tells the inference side that the client went
  away.
- `StreamSink(write, encode)`: the TokenSink of an SSE route, writing its tokens' chunks from the batching loop.
- `Timings`, `record_success`, `timing_headers`: TGI's request metrics and x-* headers.

Like TGI, a concurrency permit is taken (without waiting) *before* validation and held until the request
ends; best_of takes one permit per sequence. These helpers do not count `tgi_request_count`: each route
does, once per request (TGI's chat routes count twice).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import trace

from textgen_router import metrics
from textgen_router.schemas import GenerateParameters
from textgen_router.sse import ChunkWriter
from textgen_router.state import RouterState
from textgen_router.types import (
    EndEvent,
    GeneratedText,
    IncompleteGenerationError,
    IntermediateEvent,
    PrefillEvent,
    StreamEvent,
    Token,
    TokenSink,
    ValidationError,
    ValidRequest,
)

tracer = trace.get_tracer("textgen_router")
T = TypeVar("T")


@dataclass
class Generation:
    """A finished sequence: its request, tokens and the queue/batch timestamps (time.monotonic())."""

    request: ValidRequest
    generated_text: GeneratedText
    queued: float
    start: float
    prefill: list[Token] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)

    @property
    def mean_logprob(self) -> float:
        return sum(t.logprob for t in self.tokens) / len(self.tokens) if self.tokens else float("-inf")


class StreamSink:
    """An SSE route's TokenSink: writes each streamed token's chunk to the client from the batching loop.

    `encode(index, event)` makes the chunk of the index-th token (from 1). Once `write` declined a chunk, the
    events come through the route's stream instead, to be encoded with the same function and numbered with
    `next_index()`, which also numbers the last event.
    """

    __slots__ = ("_write", "_encode", "_direct", "index")

    def __init__(self, write: ChunkWriter, encode: Callable[[int, IntermediateEvent], bytes]) -> None:
        self._write = write
        self._encode = encode
        self._direct = True
        self.index = 0  # tokens sent or handed to the stream so far

    def __call__(self, event: IntermediateEvent) -> bool:
        if self._direct and self._write(self._encode(self.index + 1, event)):
            self.index += 1
            return True
        self._direct = False
        return False

    def next_index(self) -> int:
        self.index += 1
        return self.index


async def validate(
    state: RouterState, inputs: str, parameters: GenerateParameters, add_special_tokens: bool = True
) -> ValidRequest:
    """Validator.validate in a `validate` span, counting failures as tgi_request_failure{err="validation"}."""
    with tracer.start_as_current_span("validate"):
        try:
            return await state.validator.validate(inputs, parameters, add_special_tokens)
        except ValidationError:
            metrics.REQUEST_FAILURE.labels("validation").inc()
            raise


async def stream(
    state: RouterState,
    inputs: str,
    parameters: GenerateParameters,
    add_special_tokens: bool = True,
    sink: TokenSink | None = None,
) -> AsyncGenerator[tuple[ValidRequest, StreamEvent], None]:
    """Take a permit, validate, enqueue; yield each event of the request until its EndEvent.

    Raises InferError subclasses (OverloadedError, ValidationError, GenerationError, ...) from the
    iteration; if the inference side stops without an EndEvent, raises IncompleteGenerationError.
    """
    ended = False
    with state.infer.acquire_permit():
        request = await validate(state, inputs, parameters, add_special_tokens)
        # Read the inference stream to its own end: closing it early means "the client went away".
        async with aclosing(state.infer.generate_stream(request, sink)) as events:
            async for event in events:
                ended = ended or isinstance(event, EndEvent)
                yield request, event
    if not ended:
        metrics.REQUEST_FAILURE.labels("incomplete").inc()
        raise IncompleteGenerationError()


async def generate(
    state: RouterState, inputs: str, parameters: GenerateParameters, add_special_tokens: bool = True
) -> Generation:
    """Run one request to its end and collect its tokens."""
    prefill: list[Token] = []
    tokens: list[Token] = []
    top_tokens: list[list[Token]] = []
    end: tuple[ValidRequest, EndEvent] | None = None

    def collect(event: IntermediateEvent) -> bool:
        tokens.append(event.token)
        top_tokens.append(event.top_tokens)
        return True

    # The tokens before the last are collected by the batching loop itself: the task wakes up once, at the end.
    async with aclosing(stream(state, inputs, parameters, add_special_tokens, collect)) as events:
        async for request, event in events:  # noqa: B007 - `request` is read after the loop
            if isinstance(event, PrefillEvent):
                prefill = event.tokens
                continue
            tokens.append(event.token)
            top_tokens.append(event.top_tokens)
            if isinstance(event, EndEvent):
                end = request, event
    assert end is not None  # stream() raises IncompleteGenerationError when no EndEvent came
    request, last = end
    return Generation(request, last.generated_text, last.queued, last.start, prefill, tokens, top_tokens)


async def generate_best_of(
    state: RouterState, inputs: str, parameters: GenerateParameters, best_of: int
) -> tuple[Generation, list[Generation]]:
    """`best_of` sequences at once; the winner has the highest mean token logprob, the rest follow in order."""
    finished = await all_or_first_error(generate(state, inputs, parameters) for _ in range(best_of))
    best = max(range(len(finished)), key=lambda i: finished[i].mean_logprob)
    return finished[best], [g for i, g in enumerate(finished) if i != best]


async def all_or_first_error(runs: Iterable[Awaitable[T]]) -> list[T]:
    """Every run's result, in order; as soon as one fails, the runs not yet started are not, the others are
    cancelled, and its error is raised.

    TGI joins the sequences of a request (best_of, a /v1/completions prompt list) with `try_join_all` /
    `try_collect`, which poll them in order and drop them all at the first error: an error found before any
    wait (a validation rule, no concurrency permit) is counted once in tgi_request_failure, and no sibling keeps
    generating for an answer that will not be sent (a cancelled one leaves its batch as a client disconnect
    does). `runs` is consumed lazily, so pass a generator."""
    tasks: list[asyncio.Future[T]] = []
    try:
        for run in runs:
            tasks.append(asyncio.ensure_future(run))
            await asyncio.sleep(0)  # the run's first step, up to its first wait, happens now
            if any(_error(task) is not None for task in tasks):  # this one, or one started before it
                break
        else:
            if tasks:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = _error(task)
            if error is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _error(task: asyncio.Future[Any]) -> BaseException | None:
    """The error a finished task raised; None while it runs, or if it returned or was cancelled."""
    return task.exception() if task.done() and not task.cancelled() else None


@dataclass
class Timings:
    """TGI's per-request durations in seconds: validation = queued - start_time, queue = batch start - queued."""

    total: float
    validation: float
    queue: float
    inference: float
    per_token: float

    @classmethod
    def measure(cls, start_time: float, queued: float, start: float, generated_tokens: int) -> Timings:
        now = time.monotonic()
        inference = now - start
        return cls(
            now - start_time, queued - start_time, start - queued, inference, inference / max(generated_tokens, 1)
        )


def record_success(timings: Timings, generated_tokens: int) -> None:
    """The metrics TGI records when a generation succeeds."""
    metrics.REQUEST_SUCCESS.inc()
    metrics.REQUEST_DURATION.observe(timings.total)
    metrics.REQUEST_VALIDATION_DURATION.observe(timings.validation)
    metrics.REQUEST_QUEUE_DURATION.observe(timings.queue)
    metrics.REQUEST_INFERENCE_DURATION.observe(timings.inference)
    metrics.REQUEST_MEAN_TIME_PER_TOKEN_DURATION.observe(timings.per_token)
    metrics.REQUEST_GENERATED_TOKENS.observe(generated_tokens)


def timing_headers(
    state: RouterState, timings: Timings, compute_characters: int, prompt_tokens: int, generated_tokens: int
) -> dict[str, str]:
    """The x-* headers of a non-streaming generation (times in whole milliseconds, x-compute-time in s)."""
    ms = lambda seconds: str(int(seconds * 1000))  # noqa: E731
    return {
        "x-compute-type": state.compute_type,
        "x-compute-time": repr(timings.total),
        "x-compute-characters": str(compute_characters),
        "x-total-time": ms(timings.total),
        "x-validation-time": ms(timings.validation),
        "x-queue-time": ms(timings.queue),
        "x-inference-time": ms(timings.inference),
        "x-time-per-token": ms(timings.per_token),
        "x-prompt-tokens": str(prompt_tokens),
        "x-generated-tokens": str(generated_tokens),
    }
