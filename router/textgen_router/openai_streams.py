"""The SSE bodies of the OpenAI routes' streams (`stream: true`).

Both end with `data:[DONE]`. Anything that fails once the stream has started (validation, overload,
generation) is sent in-band as `data:{"error":{"message","http_status_code"}}` on the 200 stream, before
`[DONE]`. Each stream ends its request span.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from opentelemetry import trace
from opentelemetry.trace import Span

from textgen_router import generation, jsonenc
from textgen_router import openai_responses as bodies
from textgen_router.generation import Timings
from textgen_router.openai_schemas import ChatRequest
from textgen_router.schemas import GenerateParameters
from textgen_router.sse import ChunkWriter, event
from textgen_router.state import RouterState
from textgen_router.types import EndEvent, InferError, IntermediateEvent, PrefillEvent

DONE = event(b"[DONE]")


def _error_event(err: InferError) -> bytes:
    return event(jsonenc.dumps(bodies.stream_error(str(err), err.status_code)))


def _record(end: EndEvent, start_time: float) -> None:
    generated = end.generated_text
    timings = Timings.measure(start_time, end.queued, end.start, generated.generated_tokens)
    generation.record_success(timings, generated.generated_tokens)


async def chat_stream(
    state: RouterState,
    env: bodies.Envelope,
    body: ChatRequest,
    prompt: str,
    parameters: GenerateParameters,
    start_time: float,
    span: Span,
    write: ChunkWriter,
) -> AsyncGenerator[bytes, None]:
    """One chunk per token (the last with its finish_reason), then the usage chunk if asked for; the batching
    loop writes the token chunks itself while it can (see generation.StreamSink)."""
    chunks = bodies.ChatChunks(env)

    def token_chunk(ev: IntermediateEvent | EndEvent, finish_reason: str | None = None) -> bytes:
        logprobs = bodies.chat_logprobs([ev.token], [ev.top_tokens]) if body.logprobs else None
        return event(chunks.token(ev.token, logprobs, finish_reason))

    with trace.use_span(span, end_on_exit=True):
        try:
            sink = generation.StreamSink(write, lambda _index, ev: token_chunk(ev))
            stream = generation.stream(state, prompt, parameters, add_special_tokens=False, sink=sink)
            async with aclosing(stream) as events:
                async for valid, ev in events:
                    if isinstance(ev, PrefillEvent):
                        continue
                    if not isinstance(ev, EndEvent):
                        yield token_chunk(ev)
                        continue
                    generated = ev.generated_text
                    yield token_chunk(ev, generated.finish_reason)
                    _record(ev, start_time)
                    if body.stream_options is not None and body.stream_options.include_usage:
                        usage = bodies.chat_usage_chunk(env, valid.input_length, generated.generated_tokens)
                        yield event(jsonenc.dumps(usage))
        except InferError as err:
            yield _error_event(err)
        yield DONE


async def completion_stream(
    state: RouterState,
    env: bodies.Envelope,
    prompts: list[str],
    parameters: GenerateParameters,
    start_time: float,
    span: Span,
) -> AsyncGenerator[bytes, None]:
    """Every prompt streams concurrently; their chunks interleave on one SSE stream (TGI's behaviour)."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    chunks = bodies.CompletionChunks(env)

    async def run(index: int, prompt: str) -> None:
        try:
            async with aclosing(generation.stream(state, prompt, parameters)) as events:
                async for valid, ev in events:
                    if isinstance(ev, PrefillEvent):
                        continue
                    if not isinstance(ev, EndEvent):
                        await queue.put(event(chunks.token(index, ev.token.text, "", None)))
                        continue
                    generated = ev.generated_text
                    _record(ev, start_time)
                    usage = bodies.usage(valid.input_length, generated.generated_tokens)
                    await queue.put(event(chunks.token(index, ev.token.text, generated.finish_reason, usage)))
        except InferError as err:
            await queue.put(_error_event(err))
        finally:
            await queue.put(None)

    with trace.use_span(span, end_on_exit=True):
        tasks = [asyncio.create_task(run(i, p)) for i, p in enumerate(prompts)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                else:
                    yield item
            yield DONE
        finally:
            # The client went away (or we are done): stop every generation still in flight.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
