"""Reading JSON request bodies with the rejections of TGI's HTTP framework (axum's `Json` extractor).

- no / wrong content type -> 415 `Expected request with \\`Content-Type: application/json\\``
- body over --payload-limit -> 413 `Failed to buffer the request body: length limit exceeded`
- not JSON -> 400 `Failed to parse the request body as JSON: ...`, with serde_json's wording and position (the
  parser is pydantic's jiter, modelled on serde_json): as in TGI this includes `NaN` / `Infinity`, nesting past
  the recursion limit and unpaired surrogate escapes (`"\\ud800"`); also integers of more than 4,300 digits
  (Python's int-str limit), which TGI skips in an ignored field
- JSON of the wrong shape (missing `inputs`, wrong types) -> 422
  `Failed to deserialize the JSON body into the target type: ...`
All as plain text, not the {"error", "error_type"} shape. Unknown fields are ignored by the models.
Reused by the OpenAI routes: `await read_json(request, ChatRequest)`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic_core
from fastapi import Request
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import PlainTextResponse

ModelT = TypeVar("ModelT", bound=BaseModel)

DEFAULT_PAYLOAD_LIMIT = 2_000_000


class BodyError(Exception):
    """A request body rejected before any handler logic; rendered as plain text with `status`."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text

    def response(self) -> PlainTextResponse:
        return PlainTextResponse(self.text, status_code=self.status)


def _is_json(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


async def read_bytes(request: Request) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed the app's payload limit."""
    limit: int = getattr(request.app.state, "payload_limit", DEFAULT_PAYLOAD_LIMIT)
    too_large = BodyError(413, "Failed to buffer the request body: length limit exceeded")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody reads the answer; without it the disconnect surfaced as an unhandled exception (an ERROR log).
        raise BodyError(400, "Failed to buffer the request body: client disconnected") from None
    body = b"".join(chunks)
    # Starlette's own cache, so a second reader of this request (the /invocations dispatch) sees it too.
    request._body = body
    return body


def _describe(err: PydanticValidationError) -> str:
    first = err.errors(include_url=False)[0]
    loc = ".".join(str(part) for part in first["loc"])
    if first["type"] == "missing":
        return f"missing field `{first['loc'][-1]}`"
    return f"{loc}: {first['msg']}" if loc else first["msg"]


async def read_json_value(request: Request) -> Any:
    """The decoded JSON value of the body (content type, size and syntax checked)."""
    if not _is_json(request.headers.get("content-type", "")):
        raise BodyError(415, "Expected request with `Content-Type: application/json`")
    raw = await read_bytes(request)
    try:
        # jiter, not the json module: it refuses what serde_json refuses (NaN, Infinity, 200+ levels of nesting,
        # lone surrogates) where json.loads accepted them or failed with a 500 (deep nesting, huge integers).
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as err:
        raise BodyError(400, f"Failed to parse the request body as JSON: {err}") from None


def parse_model(value: Any, model: type[ModelT]) -> ModelT:
    """`value` as `model`, or a 422 BodyError with the first problem found."""
    try:
        return model.model_validate(value)
    except PydanticValidationError as err:
        raise BodyError(422, f"Failed to deserialize the JSON body into the target type: {_describe(err)}") from err


async def read_json(request: Request, model: type[ModelT]) -> ModelT:
    """Read, decode and validate the body as `model`, raising BodyError as axum's Json extractor would."""
    return parse_model(await read_json_value(request), model)
