"""Client exceptions, chosen from a server error's `error_type` first and its HTTP status second."""

from __future__ import annotations

from typing import Any


class TextGenerationError(Exception):
    """Base class; `str(err)` is the server's message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


# error_type driven
class ValidationError(TextGenerationError):
    """422: the request failed the server's input validation."""


class GenerationError(TextGenerationError):
    """424: a shard failed while generating."""


class OverloadedError(TextGenerationError):
    """429: all concurrency permits are taken."""


class IncompleteGenerationError(TextGenerationError):
    """500: the generation stopped before its end token."""


# status driven
class BadRequestError(TextGenerationError):
    pass


class ShardNotReadyError(TextGenerationError):
    pass


class ShardTimeoutError(TextGenerationError):
    pass


class NotFoundError(TextGenerationError):
    pass


class RateLimitExceededError(TextGenerationError):
    pass


class NotSupportedError(TextGenerationError):
    """A model the hosted Inference API does not serve. TGI's client raises it from its Inference API clients,
    which textgen has no counterpart of: it is here so that code catching it still imports."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"Model `{model_id}` is not available for inference with this client.")


class UnknownError(TextGenerationError):
    pass


_BY_ERROR_TYPE: dict[str, type[TextGenerationError]] = {
    "generation": GenerationError,
    "incomplete_generation": IncompleteGenerationError,
    "overloaded": OverloadedError,
    "validation": ValidationError,
}

_BY_STATUS: dict[int, type[TextGenerationError]] = {
    400: BadRequestError,
    403: ShardNotReadyError,
    424: ShardNotReadyError,
    504: ShardTimeoutError,
    404: NotFoundError,
    429: RateLimitExceededError,
}


def parse_error(status_code: int, payload: Any) -> TextGenerationError:
    """Turn an error response (status + decoded JSON body, or raw text) into the matching exception.

    Accepts TGI's `{"error": str, "error_type": str}` and the OpenAI stream shape
    `{"error": {"message": str, "http_status_code": int}}`.
    """
    message: str
    error_type: str | None = None
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            message = str(err.get("message", err))
            status_code = int(err.get("http_status_code", status_code))
        else:
            message = str(err if err is not None else payload)
        error_type = payload.get("error_type")
    else:
        message = str(payload)
    if error_type in _BY_ERROR_TYPE:
        return _BY_ERROR_TYPE[error_type](message)
    return _BY_STATUS.get(status_code, UnknownError)(message)
