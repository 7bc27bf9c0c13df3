"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, /chat_tokenize.

Requests are mapped onto the native generate parameters (openai_schemas) and run through the same
permit -> validation -> queue path as /generate (generation.py); bodies and chunks are built by
openai_responses. Errors raised before a stream starts (template, unsupported fields, batch size) are 422
JSON; anything that fails once a stream has started (validation, overload, generation) becomes an in-band
`data:{"error":{...}}` event on the 200 stream, which still ends with `data:[DONE]`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from textgen_router import generation, jsonenc, metrics, openai_responses as bodies
from textgen_router.body import read_json
from textgen_router.chat_template import ChatTemplate
from textgen_router.generation import Generation, Timings
from textgen_router.openai_schemas import ChatRequest, CompletionRequest
from textgen_router.responses import error as error_body
from textgen_router.schemas import GenerateParameters
from textgen_router.sse import event as sse_event, sse_response, with_keep_alive
from textgen_router.state import RouterState
from textgen_router.types import EndEvent, InferError, PrefillEvent

router = APIRouter()

def _state(request: Request) -> RouterState:
    return request.app.state.router


def _chat_template(request: Request) -> ChatTemplate:
    """Loaded by main.py at start-up (model config or --tokenizer-config-path)."""
    return request.app.state.chat_template


def _model_name(state: RouterState, requested: str | None) -> str:
    # TGI treats any name but "tgi" as a LoRA adapter id and echoes it; textgen has no adapters, so the
    # base model answers under the requested name.
    return state.model_id if requested in (None, "tgi") else requested


def _json(body: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(jsonenc.dumps(body), status_code=status_code, media_type="application/json", headers=headers)


def _error(err: InferError) -> Response:
    return _json(error_body(err), status_code=err.status_code)


# tgi_request_failure labels of the errors raised here, before a request reaches generation.py.
_FAILURE_LABELS = {"template_error": "template", "validation": "validation"}


def _rejected(err: InferError) -> Response:
    """A request refused before generation: counted as TGI counts it, answered as plain JSON."""
    label = _FAILURE_LABELS.get(err.error_type)
    if label is not None:
        metrics.REQUEST_FAILURE.labels(label).inc()
    return _error(err)


def _sse(body: Any) -> bytes:
    return sse_event(jsonenc.dumps(body))


SSE_DONE = sse_event(b"[DONE]")


def _stream_headers(state: RouterState, compute_characters: int) -> dict[str, str]:
    return {"x-compute-type": state.compute_type, "x-compute-characters": str(compute_characters)}


def _record(gen: Generation, start_time: float) -> Timings:
    timings = Timings.measure(start_time, gen.queued, gen.start, gen.generated_text.generated_tokens)
    generation.record_success(timings, gen.generated_text.generated_tokens)
    return timings


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    start_time = time.monotonic()
    # TGI counts chat requests twice: once here and once in the generate path it delegates to.
    metrics.REQUEST_COUNT.inc(2)
    state = _state(request)
    body = await read_json(request, ChatRequest)
    try:
        body.check_supported()
        prompt = _chat_template(request).apply(body.template_messages())
    except InferError as err:
        return _rejected(err)
    env = bodies.Envelope.now(_model_name(state, body.model))
    if body.stream:
        events = _chat_stream(state, env, body, prompt, start_time)
        return sse_response(with_keep_alive(events), _stream_headers(state, len(prompt)))
    try:
        gen = await generation.generate(state, prompt, body.parameters(), add_special_tokens=False)
    except InferError as err:
        return _error(err)
    timings = _record(gen, start_time)
    logprobs = bodies.chat_logprobs(gen.tokens, gen.top_tokens) if body.logprobs else None
    out = bodies.chat_completion(
        env,
        gen.generated_text.text,
        gen.generated_text.finish_reason,
        logprobs,
        gen.request.input_length,
        gen.generated_text.generated_tokens,
    )
    headers = generation.timing_headers(
        state, timings, len(prompt), gen.request.input_length, gen.generated_text.generated_tokens
    )
    return _json(out, headers=headers)


async def _chat_stream(
    state: RouterState, env: bodies.Envelope, body: ChatRequest, prompt: str, start_time: float
) -> AsyncIterator[bytes]:
    chunks = bodies.ChatChunks(env)
    try:
        async with aclosing(generation.stream(state, prompt, body.parameters(), add_special_tokens=False)) as events:
            async for valid, event in events:
                if isinstance(event, PrefillEvent):
                    continue
                logprobs = bodies.chat_logprobs([event.token], [event.top_tokens]) if body.logprobs else None
                if not isinstance(event, EndEvent):
                    yield sse_event(chunks.token(event.token, logprobs, None))
                    continue
                generated = event.generated_text
                yield sse_event(chunks.token(event.token, logprobs, generated.finish_reason))
                timings = Timings.measure(start_time, event.queued, event.start, generated.generated_tokens)
                generation.record_success(timings, generated.generated_tokens)
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield _sse(bodies.chat_usage_chunk(env, valid.input_length, generated.generated_tokens))
    except InferError as err:
        yield _sse(bodies.stream_error(str(err), err.status_code))
    yield SSE_DONE


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    start_time = time.monotonic()
    metrics.REQUEST_COUNT.inc(2)
    state = _state(request)
    body = await read_json(request, CompletionRequest)
    try:
        body.check_supported(state.max_client_batch_size)
    except InferError as err:
        return _rejected(err)
    env = bodies.Envelope.now(_model_name(state, body.model))
    prompts, parameters = body.prompts(), body.parameters()
    if body.stream:
        events = _completion_stream(state, env, prompts, parameters, start_time)
        return sse_response(with_keep_alive(events), _stream_headers(state, sum(len(p) for p in prompts)))
    runs = await asyncio.gather(
        *(generation.generate(state, p, parameters) for p in prompts), return_exceptions=True
    )
    for run in runs:
        if isinstance(run, InferError):
            return _error(run)
        if isinstance(run, BaseException):
            raise run
    gens: list[Generation] = list(runs)  # type: ignore[arg-type]
    prompt_tokens = sum(g.request.input_length for g in gens)
    completion_tokens = sum(g.generated_text.generated_tokens for g in gens)
    # TGI sums each prompt's timing headers into one set.
    each = [_record(g, start_time) for g in gens]
    fields = ("total", "validation", "queue", "inference", "per_token")
    summed = Timings(*(sum(getattr(t, name) for t in each) for name in fields))
    headers = generation.timing_headers(
        state, summed, sum(len(p) for p in prompts), prompt_tokens, completion_tokens
    )
    choices = [(g.generated_text.text, g.generated_text.finish_reason) for g in gens]
    return _json(bodies.completion(env, choices, prompt_tokens, completion_tokens), headers=headers)


async def _completion_stream(
    state: RouterState,
    env: bodies.Envelope,
    prompts: list[str],
    parameters: GenerateParameters,
    start_time: float,
) -> AsyncIterator[bytes]:
    """Every prompt streams concurrently; their chunks interleave on one SSE stream (TGI's behaviour)."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    chunks = bodies.CompletionChunks(env)

    async def run(index: int, prompt: str) -> None:
        try:
            async with aclosing(generation.stream(state, prompt, parameters)) as events:
                async for valid, event in events:
                    if isinstance(event, PrefillEvent):
                        continue
                    if not isinstance(event, EndEvent):
                        await queue.put(sse_event(chunks.token(index, event.token.text, "", None)))
                        continue
                    generated = event.generated_text
                    timings = Timings.measure(start_time, event.queued, event.start, generated.generated_tokens)
                    generation.record_success(timings, generated.generated_tokens)
                    usage = bodies.usage(valid.input_length, generated.generated_tokens)
                    chunk = chunks.token(index, event.token.text, generated.finish_reason, usage)
                    await queue.put(sse_event(chunk))
        except InferError as err:
            await queue.put(_sse(bodies.stream_error(str(err), err.status_code)))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(run(i, p)) for i, p in enumerate(prompts)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item
        yield SSE_DONE
    finally:
        # The client went away (or we are done): stop every generation still in flight.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return _json(bodies.models_list(_state(request).model_id))


@router.post("/chat_tokenize")
async def chat_tokenize(request: Request) -> Response:
    """The templated prompt and its tokens: `{"tokenize_response": [{id,text,start,stop}], "templated_text"}`."""
    metrics.REQUEST_COUNT.inc()
    state = _state(request)
    body = await read_json(request, ChatRequest)
    try:
        body.check_supported()
        prompt = _chat_template(request).apply(body.template_messages())
        encoding = await state.validator.tokenize(prompt, add_special_tokens=False)
    except InferError as err:
        return _rejected(err)
    tokens = [
        {"id": i, "text": prompt[start:stop], "start": start, "stop": stop}
        for i, (start, stop) in zip(encoding.ids, encoding.offsets)
    ]
    return _json({"tokenize_response": tokens, "templated_text": prompt})
