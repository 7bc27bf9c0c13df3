"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, /chat_tokenize.

Requests are mapped onto the native generate parameters (openai_schemas) and run through the same
permit -> validation -> queue path as /generate (generation.py); bodies and chunks are built by
openai_responses, streams by openai_streams. Errors raised before generation (template, unsupported
fields, batch size) are 422 JSON, streaming or not; later ones are JSON errors, or in-band stream events.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response

from textgen_router import generation, jsonenc, metrics, tool_grammar
from textgen_router import openai_responses as bodies
from textgen_router.body import read_json
from textgen_router.chat_input import ChatInput, chat_input
from textgen_router.chat_template import ChatTemplate, TemplateError
from textgen_router.generation import Generation, Timings
from textgen_router.handlers import until_disconnected
from textgen_router.openai_schemas import ChatRequest, CompletionRequest, OpenAIError
from textgen_router.openai_streams import chat_stream, completion_stream
from textgen_router.responses import error_response, json_response
from textgen_router.schemas import GenerateParameters
from textgen_router.sse import EventStream
from textgen_router.state import RouterState
from textgen_router.tracing import request_span, start_request_span
from textgen_router.types import InferError, ValidationError

router = APIRouter()


def _state(request: Request) -> RouterState:
    return request.app.state.router


def _chat_template(request: Request) -> ChatTemplate:
    """Loaded by main.py at start-up (model config or --tokenizer-config-path)."""
    return request.app.state.chat_template


def _model_name(state: RouterState, requested: str | None) -> str:
    # TGI echoes any name but "tgi" (the name of the adapter it selects).
    return state.model_id if requested in (None, "tgi") else requested


def _adapter_id(state: RouterState, model: str | None) -> str | None:
    """`model` as the request's adapter_id, as TGI takes it (any name but "tgi"), once adapters are loaded.

    Without adapters, any name runs the base model, as TGI's does: clients send whatever their SDK's `model`
    says. With adapters, a name that is neither the model id nor a loaded adapter is refused (422) rather
    than silently answered by the base model.
    """
    if model is not None and model != "tgi" and state.validator.adapters.names:
        return model
    return None


def _rejected(err: InferError) -> Response:
    """A request refused before generation: counted as TGI counts it, answered as plain JSON. TGI counts a
    template error as `template` and the refusals it makes itself (validation, a completion's `suffix` or prompt
    count) as `validation`; a tool error is counted under no label."""
    if isinstance(err, TemplateError):
        metrics.REQUEST_FAILURE.labels("template").inc()
    elif isinstance(err, (ValidationError, OpenAIError)):
        metrics.REQUEST_FAILURE.labels("validation").inc()
    return error_response(err)


def _stream_headers(state: RouterState, compute_characters: int) -> dict[str, str]:
    return {"x-compute-type": state.compute_type, "x-compute-characters": str(compute_characters)}


def _record(gen: Generation, start_time: float) -> Timings:
    timings = Timings.measure(start_time, gen.queued, gen.start, gen.generated_text.generated_tokens)
    generation.record_success(timings, gen.generated_text.generated_tokens)
    return timings


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    start_time = time.monotonic()
    state = _state(request)
    body = await read_json(request, ChatRequest)
    # Once per request (TGI counts its chat requests twice: here and in the generate path it delegates to), once
    # the body is read: axum refuses a bad body before TGI's handler runs.
    metrics.REQUEST_COUNT.inc()
    template = _chat_template(request)
    try:
        body.check_supported(state.validator.images is not None)
        chat = chat_input(body, template, _adapter_id(state, body.model))
    except InferError as err:
        return _rejected(err)
    env = bodies.Envelope.now(_model_name(state, body.model))
    if body.stream:
        span = start_request_span("chat_completions", request.headers)
        return EventStream(
            lambda write: chat_stream(state, env, body, chat, start_time, span, write),
            _stream_headers(state, len(chat.prompt)),
        )
    with request_span("chat_completions", request.headers):
        return await until_disconnected(request, _chat(state, env, body, chat, start_time))


async def _chat(
    state: RouterState, env: bodies.Envelope, body: ChatRequest, chat: ChatInput, start_time: float
) -> Response:
    call: tool_grammar.Call | None = None
    try:
        gen = await generation.generate(state, chat.prompt, chat.parameters, add_special_tokens=False)
        if chat.without_tools is not None:
            call = tool_grammar.parse_call(gen.generated_text.text)
            if call is None:  # the model chose `no_tool`
                chat = chat.without_tools()
                gen = await generation.generate(state, chat.prompt, chat.parameters, add_special_tokens=False)
    except InferError as err:
        return error_response(err)
    timings = _record(gen, start_time)
    text, prompt_tokens = gen.generated_text, gen.request.input_length
    logprobs = bodies.chat_logprobs(gen.tokens, gen.top_tokens) if body.logprobs else None
    out = bodies.chat_completion(
        env, text.text, text.finish_reason, logprobs, prompt_tokens, text.generated_tokens, call
    )
    headers = generation.timing_headers(state, timings, len(chat.prompt), prompt_tokens, text.generated_tokens)
    return json_response(out, headers=headers)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    start_time = time.monotonic()
    state = _state(request)
    body = await read_json(request, CompletionRequest)
    metrics.REQUEST_COUNT.inc()
    try:
        body.check_supported(state.max_client_batch_size)
    except InferError as err:
        return _rejected(err)
    # Unlike chat, TGI's completions always report the served model, whatever `model` selected.
    env = bodies.Envelope.now(state.model_id)
    prompts, parameters = body.prompts(), body.parameters()
    parameters.adapter_id = _adapter_id(state, body.model)
    if body.stream:
        span = start_request_span("completions", request.headers)
        events = completion_stream(state, env, prompts, parameters, start_time, span)
        return EventStream(events, _stream_headers(state, sum(len(p) for p in prompts)))
    with request_span("completions", request.headers):
        return await until_disconnected(request, _complete(state, env, prompts, parameters, start_time))


async def _complete(
    state: RouterState, env: bodies.Envelope, prompts: Sequence[str], parameters: GenerateParameters,
    start_time: float,
) -> Response:  # fmt: skip
    """Every prompt at once; the first error answers the request (the other prompts are given up)."""
    try:
        gens = await generation.all_or_first_error(generation.generate(state, p, parameters) for p in prompts)
    except InferError as err:
        return error_response(err)
    prompt_tokens = sum(g.request.input_length for g in gens)
    completion_tokens = sum(g.generated_text.generated_tokens for g in gens)
    # TGI sums each prompt's timing headers into one set.
    each = [_record(g, start_time) for g in gens]
    fields = ("total", "validation", "queue", "inference", "per_token")
    summed = Timings(*(sum(getattr(t, name) for t in each) for name in fields))
    headers = generation.timing_headers(state, summed, sum(len(p) for p in prompts), prompt_tokens, completion_tokens)
    choices = [(g.generated_text.text, g.generated_text.finish_reason) for g in gens]
    return json_response(bodies.completion(env, choices, prompt_tokens, completion_tokens), headers=headers)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = _state(request)
    return json_response(bodies.models_list(state.model_id, state.validator.adapters.names))


@router.post("/chat_tokenize")
async def chat_tokenize(request: Request) -> Response:
    """The templated prompt and its tokens: `{"tokenize_response": [{id,text,start,stop}], "templated_text"}`."""
    state = _state(request)
    body = await read_json(request, ChatRequest)
    metrics.REQUEST_COUNT.inc()
    try:
        body.check_supported(state.validator.images is not None)
        prompt = chat_input(body, _chat_template(request)).prompt
        tokens = await state.validator.token_list(prompt, add_special_tokens=False)
    except InferError as err:
        return _rejected(err)
    out = b'{"tokenize_response":' + tokens + b',"templated_text":' + jsonenc.string(prompt).encode() + b"}"
    return Response(out, media_type="application/json")
