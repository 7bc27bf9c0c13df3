"""TGI's native routes: /generate, /generate_stream, / (compat), /invocations, /tokenize, /info, /health,
/ping, GET /, /metrics. Request bodies are read by body.py (axum's rejections); OpenAPI docs per route.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from textgen_router import metrics, openai, schemas
from textgen_router.body import parse_model, read_json, read_json_value
from textgen_router.handlers import generate_internal, generate_stream_internal, until_disconnected
from textgen_router.responses import error_response, json_response
from textgen_router.state import RouterState
from textgen_router.tracing import request_span, start_request_span
from textgen_router.types import InferError


def _state(request: Request) -> RouterState:
    return request.app.state.router


routes = APIRouter()


@routes.post(
    "/generate",
    response_model=schemas.GenerateResponse,
    summary="Generate tokens",
)
async def generate(request: Request) -> Response:
    start_time = time.monotonic()
    req = await read_json(request, schemas.GenerateRequest)
    metrics.REQUEST_COUNT.inc()
    with request_span("generate", request.headers) as span:
        return await until_disconnected(request, generate_internal(_state(request), req, start_time, span))


@routes.post(
    "/generate_stream",
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/StreamResponse"}}},
            "description": "Generated Text",
        }
    },
    summary="Generate a stream of token using Server-Sent Events",
)
async def generate_stream(request: Request) -> Response:
    start_time = time.monotonic()
    req = await read_json(request, schemas.GenerateRequest)
    metrics.REQUEST_COUNT.inc()
    return generate_stream_internal(
        _state(request), req, start_time, start_request_span("generate_stream", request.headers)
    )


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
    "/",
    response_model=list[schemas.GenerateResponse],
    summary="Generate tokens if `stream == false` or a stream of token if `stream == true`",
)
async def compat_generate(request: Request) -> Response:
    return await _compat(request, await read_json(request, schemas.CompatGenerateRequest))


@routes.post(
    "/invocations",
    summary="Generate tokens from Sagemaker request",
)
async def sagemaker_compatibility(request: Request) -> Response:
    """TGI's untagged union: a generate body (`inputs`), else a chat (`messages`), else a completion (`prompt`)."""
    value = await read_json_value(request)
    if isinstance(value, dict) and "inputs" not in value:
        if "messages" in value:
            return await openai.chat_completions(request)
        if "prompt" in value:
            return await openai.completions(request)
    return await _compat(request, parse_model(value, schemas.CompatGenerateRequest))


@routes.post(
    "/tokenize",
    response_model=list[schemas.SimpleToken],
    summary="Tokenize inputs",
)
async def tokenize(request: Request) -> Response:
    req = await read_json(request, schemas.GenerateRequest)
    state = _state(request)
    with request_span("tokenize", request.headers):
        try:
            # TGI tokenizes the whole input here: `parameters` (truncate included) are not read.
            body = await state.validator.token_list(req.inputs)
        except InferError as err:
            return error_response(err)
    return Response(body, media_type="application/json")


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
    routes.add_api_route(
        _path, _health, methods=["GET"], responses=_HEALTH_DOC, summary="Health check method", response_class=Response
    )


@routes.get("/metrics", summary="Prometheus metrics scrape endpoint", response_class=Response)
async def prometheus_metrics() -> Response:
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)
