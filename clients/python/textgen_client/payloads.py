"""Request bodies and SSE decoding shared by the sync and async clients."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from textgen_client.errors import TextGenerationError, ValidationError, parse_error
from textgen_client.types import ChatMessage, ChatRequest, CompletionRequest, Parameters, Request

DONE = object()
"""Returned by `parse_sse_line` for the OpenAI routes' terminal `data:[DONE]`."""


@contextmanager
def _refusals() -> Iterator[None]:
    """pydantic's own refusals (a wrong type, an unknown key) as the client's `ValidationError`, the exception
    every other client-side check raises, so one `except` catches a request refused before it is sent."""
    try:
        yield
    except PydanticValidationError as err:
        problems = "; ".join(
            f"`{'.'.join(map(str, e['loc']))}`: {e['msg']}" if e["loc"] else e["msg"] for e in err.errors()
        )
        raise ValidationError(problems) from err


def generate_body(
    prompt: str, stream: bool, stop_sequences: list[str] | None = None, **parameters: Any
) -> dict[str, Any]:
    """Body for POST / from the clients' generate parameters (TGI's names: `stop_sequences` fills `stop`);
    validated client-side, every field sent (nulls included) as TGI's client does."""
    with _refusals():
        request = Request(
            inputs=prompt,
            stream=stream,
            parameters=Parameters(details=True, stop=stop_sequences or [], **parameters),
        )
    return request.model_dump(mode="json")


def chat_body(
    messages: Sequence[ChatMessage], stream: bool, repetition_penalty: float | None = None, **kwargs: Any
) -> dict[str, Any]:
    """Body for POST /v1/chat/completions; unset optional fields are left out."""
    if repetition_penalty is not None:
        # TGI's client sends it and TGI's server ignores it as an unknown field: refused, not silently lost.
        raise ValidationError(
            "`repetition_penalty` is not supported by /v1/chat/completions: use `frequency_penalty` or "
            "`presence_penalty`"
        )
    # Validated from plain data: a turn may be a dict or a reply's message as well as a `Message`.
    with _refusals():
        request = ChatRequest.model_validate({"messages": list(messages), "stream": stream, **kwargs})
    return request.model_dump(mode="json", exclude_none=True)


def completion_body(prompt: str | list[str], stream: bool, **kwargs: Any) -> dict[str, Any]:
    """Body for POST /v1/completions; unset optional fields are left out."""
    with _refusals():
        request = CompletionRequest(prompt=prompt, stream=stream, **kwargs)
    return request.model_dump(mode="json", exclude_none=True)


def error_from_body(status_code: int, body: bytes) -> TextGenerationError:
    try:
        payload: Any = json.loads(body)
    except ValueError:
        payload = body.decode(errors="replace")
    return parse_error(status_code, payload)


def parse_sse_line(line: str) -> dict[str, Any] | object | None:
    """Decode one SSE line: its JSON payload, `DONE`, or None for blank/comment lines.

    Raises the matching `TextGenerationError` when the event is an error event (streams report errors
    in-band on an HTTP 200).
    """
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return DONE
    payload = json.loads(data)
    if isinstance(payload, dict) and "error" in payload:
        raise parse_error(200, payload)
    return payload


def parse_event(model: type[BaseModel], payload: dict[str, Any]) -> Any:
    try:
        return model.model_validate(payload)
    except PydanticValidationError as err:
        raise parse_error(200, {"error": f"unexpected stream event {payload!r}: {err}"}) from err
