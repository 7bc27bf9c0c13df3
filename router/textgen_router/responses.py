"""Response bodies of the native routes as ordered dicts, in TGI's field order (see schemas.py for types).

`json_response` encodes them with `jsonenc.dumps`, byte-identical to TGI's serde output.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import Response

from textgen_router import jsonenc
from textgen_router.generation import Generation
from textgen_router.types import InferError, Token

logger = logging.getLogger("textgen_router")


def token(t: Token) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def prefill_token(t: Token) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": t.logprob}


def error(err: InferError) -> dict[str, str]:
    return {"error": str(err), "error_type": err.error_type}


def _output_text(gen: Generation, add_prompt: str | None) -> str:
    return gen.generated_text.text if add_prompt is None else add_prompt + gen.generated_text.text


def generate_response(
    gen: Generation, others: list[Generation] | None, details: bool, add_prompt: str | None
) -> dict[str, Any]:
    """GenerateResponse: `details` only when asked (details or decoder_input_details)."""
    body: dict[str, Any] = {"generated_text": _output_text(gen, add_prompt)}
    if not details:
        return body
    out: dict[str, Any] = {
        "finish_reason": gen.generated_text.finish_reason,
        "generated_tokens": gen.generated_text.generated_tokens,
        "seed": gen.generated_text.seed,
        "prefill": [prefill_token(t) for t in gen.prefill],
        "tokens": [token(t) for t in gen.tokens],
    }
    if others is not None:
        out["best_of_sequences"] = [_best_of_sequence(g, add_prompt) for g in others]
    top = _top_tokens(gen)
    if top:
        out["top_tokens"] = top
    body["details"] = out
    return body


def _top_tokens(gen: Generation) -> list[list[dict[str, Any]]]:
    # TGI omits the field unless top_n_tokens > 0 was asked for.
    if gen.request.top_n_tokens == 0:
        return []
    return [[token(t) for t in step] for step in gen.top_tokens]


def _best_of_sequence(gen: Generation, add_prompt: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "generated_text": _output_text(gen, add_prompt),
        "finish_reason": gen.generated_text.finish_reason,
        "generated_tokens": gen.generated_text.generated_tokens,
        "seed": gen.generated_text.seed,
        "prefill": [prefill_token(t) for t in gen.prefill],
        "tokens": [token(t) for t in gen.tokens],
    }
    top = _top_tokens(gen)
    if top:
        out["top_tokens"] = top
    return out


def stream_response(
    index: int,
    tok: Token,
    top_tokens: list[Token],
    generated_text: str | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One /generate_stream event: `top_tokens` omitted when empty; the last one carries the text."""
    out: dict[str, Any] = {"index": index, "token": token(tok)}
    if top_tokens:
        out["top_tokens"] = [token(t) for t in top_tokens]
    out["generated_text"] = generated_text
    out["details"] = details
    return out


def stream_token_event(index: int, tok: Token) -> bytes:
    """`jsonenc.dumps(stream_response(index, tok, []))` written directly: the hot path of /generate_stream
    (once per token per stream), where building and walking the dict cost more than the bytes."""
    return (
        f'{{"index":{index},"token":{{"id":{tok.id},"text":{jsonenc.string(tok.text)},'
        f'"logprob":{jsonenc.format_f32(tok.logprob)},"special":{"true" if tok.special else "false"}}},'
        '"generated_text":null,"details":null}'
    ).encode()


def stream_details(finish_reason: str, generated_tokens: int, seed: int | None, input_length: int) -> dict[str, Any]:
    return {
        "finish_reason": finish_reason,
        "generated_tokens": generated_tokens,
        "seed": seed,
        "input_length": input_length,
    }


def json_response(body: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded byte-for-byte as TGI's serde_json would."""
    return Response(jsonenc.dumps(body), status_code=status_code, media_type="application/json", headers=headers)


def error_response(err: InferError) -> Response:
    logger.error("%s", err)
    return json_response(error(err), status_code=err.status_code)
