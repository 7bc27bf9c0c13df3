"""How a native generate request becomes a response: TGI's `generate_internal` / `generate_stream_internal`.

- `generate_internal(state, req, start_time, span)` -> JSON Response (best_of included) with the x-* headers.
- `generate_stream_internal(state, req, start_time, span)` -> 200 SSE Response; every error is an event on it.
- `until_disconnected(request, work)`: cancel a non-streaming generation when its client goes away.
Neither counts tgi_request_count (the route handlers do, once per handler, as TGI).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from opentelemetry import trace
from opentelemetry.trace import Span

from textgen_router import generation, jsonenc, metrics, responses, schemas
from textgen_router.generation import Timings
from textgen_router.responses import error_response, json_response
from textgen_router.sse import ChunkWriter, EventStream, client_disconnected, event
from textgen_router.state import RouterState
from textgen_router.types import (
    EndEvent,
    IncompleteGenerationError,
    InferError,
    IntermediateEvent,
    PrefillEvent,
    ValidationError,
    ValidRequest,
)

logger = logging.getLogger("textgen_router")


class IncompleteGenerationStreamError(InferError):
    status_code = 500
    error_type = "incomplete_generation_stream"

    def __init__(self) -> None:
        super().__init__("Incomplete generation stream")


async def generate_internal(
    state: RouterState, req: schemas.GenerateRequest, start_time: float, span: Span
) -> Response:
    """Run a non-streaming generation (best_of included) into TGI's JSON body and x-* headers."""
    p = req.parameters
    add_prompt = req.inputs if p.return_full_text else None
    try:
        best_of = 1 if p.best_of is None else state.validator.validate_best_of(p.best_of)
        if best_of > 1:
            gen, others = await generation.generate_best_of(state, req.inputs, p, best_of)
        else:
            gen, others = await generation.generate(state, req.inputs, p), None
    except InferError as err:
        return error_response(err)
    generated_tokens = gen.generated_text.generated_tokens
    timings = Timings.measure(start_time, gen.queued, gen.start, generated_tokens)
    generation.record_success(timings, generated_tokens)
    span.set_attributes(_span_fields(timings, gen.generated_text.seed))
    logger.info("Success", extra={"fields": {"output": gen.generated_text.text}})
    body = responses.generate_response(gen, others, p.details or p.decoder_input_details, add_prompt)
    headers = generation.timing_headers(state, timings, len(req.inputs), gen.request.input_length, generated_tokens)
    return json_response(body, headers=headers)


def _span_fields(timings: Timings, seed: int | None) -> dict[str, Any]:
    fields = {
        "total_time": f"{timings.total:.6f}s",
        "validation_time": f"{timings.validation:.6f}s",
        "queue_time": f"{timings.queue:.6f}s",
        "inference_time": f"{timings.inference:.6f}s",
        "time_per_token": f"{timings.per_token:.6f}s",
    }
    if seed is not None:
        fields["seed"] = str(seed)
    return fields


def generate_stream_internal(
    state: RouterState, req: schemas.GenerateRequest, start_time: float, span: Span
) -> Response:
    """A 200 SSE stream of TGI's StreamResponse events; every error is an event on it. Ends `span`."""
    headers = {"x-compute-type": state.compute_type, "x-compute-characters": str(len(req.inputs))}
    return EventStream(lambda write: _stream_events(state, req, start_time, span, write), headers)


def _token_event(index: int, ev: IntermediateEvent) -> bytes:
    if ev.top_tokens:
        return event(jsonenc.dumps(responses.stream_response(index, ev.token, ev.top_tokens)))
    return event(responses.stream_token_event(index, ev.token))


async def _stream_events(
    state: RouterState, req: schemas.GenerateRequest, start_time: float, span: Span, write: ChunkWriter
) -> AsyncGenerator[bytes, None]:
    """The events the batching loop did not write itself (see generation.StreamSink), then the last one."""
    p = req.parameters
    with trace.use_span(span, end_on_exit=True):
        try:
            _check_streamable(p)
            sink = generation.StreamSink(write, _token_event)
            async with aclosing(generation.stream(state, req.inputs, p, sink=sink)) as events:
                async for request, ev in events:
                    if isinstance(ev, PrefillEvent):
                        continue
                    index = sink.next_index()
                    if isinstance(ev, EndEvent):
                        yield _final_event(req, request, ev, index, start_time, span)
                    else:
                        yield _token_event(index, ev)
        except IncompleteGenerationError:
            # Already counted as err="incomplete"; a stream reports it under its own name.
            yield _error_event(IncompleteGenerationStreamError())
        except InferError as err:
            yield _error_event(err)


def _check_streamable(p: schemas.GenerateParameters) -> None:
    if (p.best_of if p.best_of is not None else 1) != 1:
        metrics.REQUEST_FAILURE.labels("validation").inc()
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if p.decoder_input_details:
        metrics.REQUEST_FAILURE.labels("validation").inc()
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")


def _final_event(
    req: schemas.GenerateRequest, request: ValidRequest, end: EndEvent, index: int, start_time: float, span: Span
) -> bytes:
    """The last event: the whole text (with the prompt if return_full_text) and, if asked, the details."""
    text = end.generated_text
    timings = Timings.measure(start_time, end.queued, end.start, text.generated_tokens)
    generation.record_success(timings, text.generated_tokens)
    span.set_attributes(_span_fields(timings, text.seed))
    logger.info("Success", extra={"fields": {"output": text.text}})
    details = None
    if req.parameters.details:
        details = responses.stream_details(text.finish_reason, text.generated_tokens, text.seed, request.input_length)
    output = req.inputs + text.text if req.parameters.return_full_text else text.text
    return event(jsonenc.dumps(responses.stream_response(index, end.token, end.top_tokens, output, details)))


def _error_event(err: InferError) -> bytes:
    logger.error("%s", err)
    return event(jsonenc.dumps(responses.error(err)))


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, or a 499 after cancelling it if the client goes away first.

    As in TGI (where axum drops the handler's future), a non-streaming request whose client left stops
    generating: the cancelled stream takes the request out of its batch and gives the permit back.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        await client_disconnected(request.receive)
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if not watcher.done():
            raise  # cancelled from outside (shutdown), not by the client leaving
        logger.info("client disconnected, generation cancelled")
        return Response(status_code=499)
    finally:
        watcher.cancel()
