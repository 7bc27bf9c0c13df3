"""The router's HTTP app: TGI's native routes, middleware, and the OpenAI routes included from openai.py.

`create_app(state, ...)` builds the FastAPI app; `state` (RouterState) may be None to only render the
OpenAPI spec (`textgen-router print-schema`). Handlers reach the state through `request.app.state.router`.

Reusable by other route modules: `generate_internal(state, req, start_time, span)` (-> JSON Response with
x-* headers) and `generate_stream_internal(state, req, start_time, span)` (-> SSE Response), which like
TGI's do not count tgi_request_count (the route handlers do).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from opentelemetry import trace
from opentelemetry.trace import Span
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from textgen_router import generation, jsonenc, metrics, openai, responses, schemas
from textgen_router.body import BodyError, parse_model, read_json, read_json_value
from textgen_router.generation import Timings
from textgen_router.sse import event, sse_response, with_keep_alive
from textgen_router.state import RouterState
from textgen_router.tracing import request_span, start_request_span
from textgen_router.types import (
    EndEvent,
    IncompleteGenerationError,
    InferError,
    PrefillEvent,
    ValidationError,
    ValidRequest,
)

logger = logging.getLogger("textgen_router")

# POST routes that need the API key (TGI leaves info, health, metrics, docs, /v1/models, /chat_tokenize open).
PROTECTED_PATHS = frozenset(
    ["/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions", "/vertex", "/invocations",
     "/tokenize"]
)


def json_response(body: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded byte-for-byte as TGI's serde_json would."""
    return Response(jsonenc.dumps(body), status_code=status_code, media_type="application/json", headers=headers)


def error_response(err: InferError) -> Response:
    logger.error("%s", err)
    return json_response(responses.error(err), status_code=err.status_code)


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
        if p.best_of is not None and p.best_of > 1:
            best_of = state.validator.validate_best_of(p.best_of)
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
    return sse_response(with_keep_alive(_stream_events(state, req, start_time, span)), headers)


async def _stream_events(
    state: RouterState, req: schemas.GenerateRequest, start_time: float, span: Span
) -> AsyncIterator[bytes]:
    p = req.parameters
    with trace.use_span(span, end_on_exit=True):
        try:
            _check_streamable(p)
            index = 0
            async with aclosing(generation.stream(state, req.inputs, p)) as events:
                async for request, ev in events:
                    if isinstance(ev, PrefillEvent):
                        continue
                    index += 1
                    if isinstance(ev, EndEvent):
                        yield _final_event(req, request, ev, index, start_time, span)
                    else:
                        yield event(jsonenc.dumps(responses.stream_response(index, ev.token, ev.top_tokens)))
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


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, or a 499 after cancelling it if the client goes away first.

    As in TGI (where axum drops the handler's future), a non-streaming request whose client left stops
    generating: the cancelled stream takes the request out of its batch and gives the permit back.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        # The body was read already: the next ASGI message is the disconnect (or the end of the response).
        while (await request.receive())["type"] != "http.disconnect":
            pass
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


routes = APIRouter()

_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    424: {"model": schemas.ErrorResponse, "description": "Generation Error"},
    429: {"model": schemas.ErrorResponse, "description": "Model is overloaded"},
    422: {"model": schemas.ErrorResponse, "description": "Input validation error"},
    500: {"model": schemas.ErrorResponse, "description": "Incomplete generation"},
}


def _body_doc(model: type) -> dict[str, Any]:
    schema_ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema_ref}}}}


@routes.post(
    "/generate", response_model=schemas.GenerateResponse, responses=_GENERATE_RESPONSES,
    openapi_extra=_body_doc(schemas.GenerateRequest), summary="Generate tokens",
)
async def generate(request: Request) -> Response:
    start_time = time.monotonic()
    req = await read_json(request, schemas.GenerateRequest)
    metrics.REQUEST_COUNT.inc()
    with request_span("generate", request.headers) as span:
        return await until_disconnected(request, generate_internal(_state(request), req, start_time, span))


@routes.post(
    "/generate_stream", responses={200: {"content": {"text/event-stream": {"schema": {
        "$ref": "#/components/schemas/StreamResponse"}}}, "description": "Generated Text"}},
    openapi_extra=_body_doc(schemas.GenerateRequest), summary="Generate a stream of token using Server-Sent Events",
)
async def generate_stream(request: Request) -> Response:
    start_time = time.monotonic()
    req = await read_json(request, schemas.GenerateRequest)
    metrics.REQUEST_COUNT.inc()
    return generate_stream_internal(_state(request), req, start_time, start_request_span("generate_stream", request.headers))


async def _compat(request: Request, req: schemas.CompatGenerateRequest) -> Response:
    start_time = time.monotonic()
    state = _state(request)
    if req.parameters.return_full_text is None:
        # TGI's pipeline default: text-generation models (and models without a hub tag) echo the prompt.
        full = state.pipeline_tag in (None, "text-generation")
        req.parameters = req.parameters.model_copy(update={"return_full_text": full})
    metrics.REQUEST_COUNT.inc()
    if req.stream:
        return generate_stream_internal(state, req, start_time, start_request_span("generate_stream", request.headers))
    with request_span("compat_generate", request.headers) as span:
        response = await until_disconnected(request, generate_internal(state, req, start_time, span))
    if response.status_code != 200:
        return response
    # POST / answers a list holding the one GenerateResponse.
    return Response(b"[" + response.body + b"]", media_type="application/json", headers=_x_headers(response))


def _x_headers(response: Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("x-")}


@routes.post(
    "/", response_model=list[schemas.GenerateResponse], responses=_GENERATE_RESPONSES,
    openapi_extra=_body_doc(schemas.CompatGenerateRequest),
    summary="Generate tokens if `stream == false` or a stream of token if `stream == true`",
)
async def compat_generate(request: Request) -> Response:
    return await _compat(request, await read_json(request, schemas.CompatGenerateRequest))


@routes.post("/invocations", summary="Generate tokens from Sagemaker request",
             openapi_extra=_body_doc(schemas.CompatGenerateRequest))
async def sagemaker_compatibility(request: Request) -> Response:
    """TGI's untagged union: a generate body (`inputs`), else a chat (`messages`), else a completion (`prompt`)."""
    value = await read_json_value(request)
    if isinstance(value, dict) and "inputs" not in value:
        if "messages" in value:
            return await openai.chat_completions(request)
        if "prompt" in value:
            return await openai.completions(request)
    return await _compat(request, parse_model(value, schemas.CompatGenerateRequest))


@routes.post("/tokenize", response_model=list[schemas.SimpleToken], openapi_extra=_body_doc(schemas.GenerateRequest),
             summary="Tokenize inputs")
async def tokenize(request: Request) -> Response:
    req = await read_json(request, schemas.GenerateRequest)
    state = _state(request)
    with request_span("tokenize", request.headers):
        try:
            encoding = await state.validator.tokenize(req.inputs, True, req.parameters.truncate)
        except InferError as err:
            return error_response(err)
    body = [
        {"id": i, "text": req.inputs[start:stop], "start": start, "stop": stop}
        for i, (start, stop) in zip(encoding.ids, encoding.offsets)
    ]
    return json_response(body)


@routes.get("/info", response_model=schemas.Info, summary="Text Generation Inference endpoint info")
async def get_model_info(request: Request) -> Response:
    return json_response(_state(request).info())


async def _health(request: Request) -> Response:
    with request_span("health", request.headers):
        healthy = await _state(request).infer.health()
    if healthy:
        return Response(status_code=200)
    return json_response({"error": "unhealthy", "error_type": "healthcheck"}, status_code=503)


_HEALTH_DOC: dict[int | str, dict[str, Any]] = {
    200: {"description": "Everything is working fine"},
    503: {"model": schemas.ErrorResponse, "description": "Text generation inference is down"},
}
for _path in ("/health", "/ping", "/"):
    routes.add_api_route(_path, _health, methods=["GET"], responses=_HEALTH_DOC, summary="Health check method",
                         response_class=Response)


@routes.get("/metrics", summary="Prometheus metrics scrape endpoint", response_class=Response)
async def prometheus_metrics() -> Response:
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


class ApiKeyMiddleware:
    """Generation routes need `Authorization: Bearer <key>` (compared case-insensitively); else 401, empty body."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PROTECTED_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if given.lower() != self.expected:
                await Response(status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    state: RouterState | None,
    *,
    api_key: str | None = None,
    cors_allow_origin: list[str] | None = None,
    payload_limit: int = 2_000_000,
) -> FastAPI:
    """The router's app. `state` None builds the routes for the OpenAPI spec only."""
    app = FastAPI(
        title="Text Generation Inference",
        description="Text Generation Webserver",
        version=_version(),
        docs_url="/docs",
        openapi_url="/api-doc/openapi.json",
        redoc_url=None,
    )
    app.state.router = state
    app.state.payload_limit = payload_limit
    app.include_router(routes)
    app.include_router(openai.router)
    app.add_exception_handler(BodyError, _body_error)  # type: ignore[arg-type]
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors_allow_origin or ["*"],
        allow_methods=["GET", "POST"],
        allow_headers=["content-type"],
    )
    return app


async def _body_error(request: Request, err: BodyError) -> Response:
    return err.response()


def _version() -> str:
    from textgen_router.state import package_version

    return package_version()


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's spec plus the request body schemas that handlers read themselves (see body.py)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        for model in (schemas.GenerateRequest, schemas.CompatGenerateRequest, schemas.StreamResponse):
            defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(defs.pop("$defs", {}))
            components[model.__name__] = defs
        app.openapi_schema = spec
    return app.openapi_schema
