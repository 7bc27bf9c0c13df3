"""The router's HTTP app: TGI's native routes (routes.py), the OpenAI routes (openai.py), API key, CORS.

`create_app(state, ...)` builds the FastAPI app; `state` (RouterState) may be None to only render the
OpenAPI spec (`textgen-router print-schema`). Handlers reach the state through `request.app.state.router`.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from textgen_router import openai, openapi_spec
from textgen_router.body import BodyError
from textgen_router.routes import routes
from textgen_router.sse import DIRECT_SEND
from textgen_router.state import RouterState, package_version

# POST routes that need the API key (TGI leaves info, health, metrics, docs, /v1/models, /chat_tokenize open).
PROTECTED_PATHS = frozenset(
    [
        "/",
        "/generate",
        "/generate_stream",
        "/v1/chat/completions",
        "/v1/completions",
        "/vertex",
        "/invocations",
        "/tokenize",
    ]
)


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


class _App(FastAPI):
    """FastAPI that hands its streams the ASGI server's `send` (sse.DIRECT_SEND): none of the middlewares
    below changes a response body, so EventStream may send its chunks past them."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[DIRECT_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(
    state: RouterState | None,
    *,
    api_key: str | None = None,
    cors_allow_origin: list[str] | None = None,
    payload_limit: int = 2_000_000,
) -> FastAPI:
    """The router's app. `state` None builds the routes for the OpenAPI spec only."""
    app = _App(
        title="Text Generation Inference",
        description="Text Generation Webserver",
        version=package_version(),
        docs_url="/docs",
        openapi_url="/api-doc/openapi.json",
        redoc_url=None,
    )
    app.state.router = state
    app.state.payload_limit = payload_limit
    app.include_router(routes)
    app.include_router(openai.router)
    app.add_exception_handler(BodyError, _body_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _routing_error)  # type: ignore[arg-type]
    app.openapi = lambda: openapi_spec.build(app, PROTECTED_PATHS)  # type: ignore[method-assign]
    # A middleware that rewrites response bodies (gzip, ...) would be bypassed by streams: see _App.
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


async def _routing_error(request: Request, err: StarletteHTTPException) -> Response:
    """An unknown path (404) or a route's other method (405, with `Allow`): status and headers only, as axum
    answers them, instead of FastAPI's `{"detail": ...}` JSON."""
    return Response(status_code=err.status_code, headers=err.headers)
