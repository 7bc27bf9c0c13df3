"""The router's OpenAPI document (`/api-doc/openapi.json`): FastAPI's spec of the routes, plus what FastAPI cannot
see because handlers read their own bodies (body.py): each JSON route's request schema, and every error
status the server really answers with, in the content type it sends it in.

Clients and the API fuzz test (router/tests/test_openapi_fuzz.py) rely on it: a response whose status or
content type the document does not list is a defect of the document or of the server.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from textgen_router import schemas
from textgen_router.openai_schemas import ChatRequest, CompletionRequest

# Routes whose handler reads its JSON body itself, and the model that body is checked against.
JSON_BODIES: dict[str, type[BaseModel]] = {
    "/generate": schemas.GenerateRequest,
    "/generate_stream": schemas.GenerateRequest,
    "/": schemas.CompatGenerateRequest,
    "/invocations": schemas.CompatGenerateRequest,
    "/tokenize": schemas.GenerateRequest,
    "/v1/chat/completions": ChatRequest,
    "/v1/completions": CompletionRequest,
    "/chat_tokenize": ChatRequest,
}
# Routes that queue a generation: they can also be refused for load or fail on a shard.
GENERATION_ROUTES = frozenset(
    ["/generate", "/generate_stream", "/", "/invocations", "/v1/chat/completions", "/v1/completions"]
)


# Routes that answer with Server-Sent Events (always, or when the body asks `stream: true`). The schema is one
# event's: its `data` is a JSON text, a token event or the error event that ends a stream (TGI's shapes for the
# native routes; OpenAI's chunks for the others).
def _event(data_schema: dict[str, Any], done: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json", "contentSchema": data_schema}
    if done:  # OpenAI's streams end with the event `data: [DONE]`
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    return {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}


_TGI_EVENT = _event(
    {"oneOf": [{"$ref": "#/components/schemas/StreamResponse"}, {"$ref": "#/components/schemas/ErrorResponse"}]}
)
_OPENAI_EVENT = _event({}, done=True)
STREAM_EVENTS: dict[str, dict[str, Any]] = {
    "/generate_stream": _TGI_EVENT,
    "/": _TGI_EVENT,
    "/invocations": _OPENAI_EVENT,  # a generate, chat or completion stream, by the body's shape
    "/v1/chat/completions": _OPENAI_EVENT,
    "/v1/completions": _OPENAI_EVENT,
}
# Extra schemas to publish: the stream's event body is not a FastAPI response model.
EXTRA_SCHEMAS: tuple[type[BaseModel], ...] = (schemas.StreamResponse,)

_TEXT = {"text/plain": {"schema": {"type": "string"}}}
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
# body.py's rejections (axum's Json extractor) are plain text; read_timeouts.py's 408 too.
_BODY_ERRORS: dict[str, dict[str, Any]] = {
    "400": {"description": "The body is not JSON", "content": _TEXT},
    "408": {"description": "Headers or body not received in time", "content": _TEXT},
    "413": {"description": "The body exceeds --payload-limit", "content": _TEXT},
    "415": {"description": "The content type is not JSON", "content": _TEXT},
}
# 422: the body's shape (plain text, from body.py) or a parameter's value (JSON, from validation).
_INVALID = {"description": "Input validation error", "content": {**_TEXT, **_ERROR}}
_GENERATION_ERRORS: dict[str, dict[str, Any]] = {
    "424": {"description": "Generation Error", "content": _ERROR},
    "429": {"description": "Model is overloaded", "content": _ERROR},
}
# The non-streaming generate routes answer 500 when a generation ends without its final token.
_INCOMPLETE = {"500": {"description": "Incomplete generation", "content": _ERROR}}
_UNAUTHORIZED = {"description": "Missing or wrong API key (when --api-key is set)"}


def build(app: FastAPI, protected_paths: frozenset[str]) -> dict[str, Any]:
    """The spec of `app`, built once and cached on it; `protected_paths` are the POST routes behind the API key."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        published: list[type[BaseModel]] = [*JSON_BODIES.values(), *EXTRA_SCHEMAS, schemas.ErrorResponse]
        for model in dict.fromkeys(published):
            _publish(components, model)
        for path, operations in spec.get("paths", {}).items():
            post = operations.get("post")
            if post is not None:
                _document_post(path, post, path in protected_paths)
        app.openapi_schema = spec
    return app.openapi_schema


def _publish(components: dict[str, Any], model: type[BaseModel]) -> None:
    defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(defs.pop("$defs", {}))
    components[model.__name__] = defs


def _document_post(path: str, operation: dict[str, Any], protected: bool) -> None:
    responses = operation.setdefault("responses", {})
    model = JSON_BODIES.get(path)
    if model is not None:
        schema = {"$ref": f"#/components/schemas/{model.__name__}"}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        for status, doc in _BODY_ERRORS.items():
            responses.setdefault(status, doc)
        responses["422"] = _INVALID
    if path in GENERATION_ROUTES:
        responses.update(_GENERATION_ERRORS)
    if path in ("/generate", "/"):
        responses.update(_INCOMPLETE)
    if path in STREAM_EVENTS:
        ok = responses.setdefault("200", {"description": "Generated Text"})
        ok.setdefault("content", {})["text/event-stream"] = {"schema": STREAM_EVENTS[path]}
    if protected:
        responses.setdefault("401", _UNAUTHORIZED)
