"""Response bodies and stream chunks of the OpenAI-compatible routes, as ordered dicts in TGI's field order.

Finish reasons: chat (both modes) and non-stream completions report `eos_token` as `stop`; completion stream
chunks carry the raw reason (`eos_token`) and `""` until a prompt's last token (a TGI quirk kept on purpose).
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from textgen_router import jsonenc
from textgen_router.tool_grammar import Call
from textgen_router.types import Token


@functools.cache
def system_fingerprint() -> str:
    """`<version>-<docker label or "native">`, as TGI builds it."""
    try:
        ours = version("textgen")
    except PackageNotFoundError:
        ours = "0.0.0"
    return f"{ours}-native"


def openai_finish_reason(reason: str) -> str:
    return "stop" if reason == "eos_token" else reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(tokens: list[Token], top_tokens: list[list[Token]]) -> dict[str, Any]:
    """`{"content": [...]}`; a token without top tokens (top_logprobs unset) gets `top_logprobs: []`."""
    content = []
    for i, token in enumerate(tokens):
        tops = top_tokens[i] if i < len(top_tokens) else []
        content.append(
            {
                "token": token.text,
                "logprob": token.logprob,
                "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in tops],
            }
        )
    return {"content": content}


@dataclass
class Envelope:
    """The fields every body and chunk of one request shares."""

    model: str
    fingerprint: str
    created: int

    @classmethod
    def now(cls, model: str) -> Envelope:
        return cls(model, system_fingerprint(), int(time.time()))

    def wrap(self, obj: str, choices: list[dict[str, Any]], usage_: dict[str, int] | str | None) -> dict[str, Any]:
        """The body of `obj` around `choices`; `usage_` may be a ChunkTemplate marker (a str)."""
        return {
            "object": obj,
            "id": "",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": usage_,
        }


def chat_completion(
    env: Envelope,
    text: str,
    finish_reason: str,
    logprobs: dict[str, Any] | None,
    prompt_tokens: int,
    completion_tokens: int,
    call: Call | None = None,
) -> dict[str, Any]:
    """The body of a chat answer: `text` as content, or, when the output was a tool call, `call` (TGI's id `0`)."""
    if call is None:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = openai_finish_reason(finish_reason)
    else:
        function = {"description": None, "name": call.name, "arguments": call.arguments}
        message = {"role": "assistant", "tool_calls": [{"id": "0", "type": "function", "function": function}]}
        reason = "tool_calls"
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
    return env.wrap("chat.completion", [choice], usage(prompt_tokens, completion_tokens))


def tool_call_chunk(
    env: Envelope,
    arguments: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    first: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A chat stream's chunk of a tool call in OpenAI's delta shape: `first` = (id, name) opens the call, later
    chunks carry only the next piece of its arguments (a client concatenates the deltas' strings)."""
    call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
    delta: dict[str, Any] = {"tool_calls": [call]}
    if first is not None:
        call_id, name = first
        call.update(id=call_id, type="function", function={"name": name, "arguments": arguments})
        delta = {"role": "assistant", **delta}
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return env.wrap("chat.completion.chunk", [choice], None)


class ChunkTemplate:
    """A JSON body encoded once with placeholders; each chunk then encodes only the placeholders' values.

    The chunks of one stream differ in a few fields only: encoding the rest (model, fingerprint, field
    names) once per request instead of once per token leaves a fraction of the per-token encoding work
    (benchmark/README.md, "Router figures").
    `build(markers)` returns the body with `markers[i]` where value i goes; markers are random, so no
    user-supplied string in the body (the echoed model name) can be mistaken for one.
    """

    def __init__(self, build: Callable[[list[str]], dict[str, Any]], slots: int) -> None:
        nonce = secrets.token_hex(8)
        markers = [f"\x00{nonce}:{i}" for i in range(slots)]
        encoded = jsonenc.dumps(build(markers))
        self.parts: list[bytes] = []
        for marker in markers:
            before, encoded = encoded.split(jsonenc.dumps(marker), 1)
            self.parts.append(before)
        self.parts.append(encoded)

    def render(self, *values: Any) -> bytes:
        return self.parts[0] + _fill(values, self.parts[1:])

    def around_first(self, *rest: Any) -> tuple[bytes, bytes]:
        """(head, tail) such that `render(v, *rest) == head + dumps(v) + tail` for every first value v."""
        return self.parts[0], self.parts[1] + _fill(rest, self.parts[2:])


def _fill(values: tuple[Any, ...], parts: list[bytes]) -> bytes:
    """Each value encoded, followed by the part after it."""
    out = []
    for value, part in zip(values, parts, strict=True):
        out.append(jsonenc.dumps(value))
        out.append(part)
    return b"".join(out)


class ChatChunks:
    """Encoded chunks of one chat stream: slots are content, logprobs and finish_reason."""

    def __init__(self, env: Envelope) -> None:
        def build(m: list[str]) -> dict[str, Any]:
            choice = {"index": 0, "delta": {"role": "assistant", "content": m[0]}, "logprobs": m[1],
                      "finish_reason": m[2]}  # fmt: skip
            return env.wrap("chat.completion.chunk", [choice], None)

        self.template = ChunkTemplate(build, 3)
        # Most chunks are a token without logprobs or finish reason: only the content is encoded per token.
        self._head, self._plain_tail = self.template.around_first(None, None)

    def token(self, token: Token, logprobs: dict[str, Any] | None, finish_reason: str | None) -> bytes:
        """One token; special tokens (e.g. the final eos) stream as empty content."""
        content = "" if token.special else token.text
        if logprobs is None and finish_reason is None:
            return self._head + jsonenc.string(content).encode() + self._plain_tail
        reason = None if finish_reason is None else openai_finish_reason(finish_reason)
        return self.template.render(content, logprobs, reason)


class CompletionChunks:
    """Encoded chunks of one completion stream: slots are index, text, finish_reason (and usage in a prompt's last).

    TGI has two shapes: a token's `Chunk` has no `usage` key and puts `choices` before `model`; a prompt's last
    chunk is a `CompletionFinal`, in the envelope's order, with `usage`.
    """

    def __init__(self, env: Envelope) -> None:
        def choices(m: list[str]) -> list[dict[str, Any]]:
            return [{"index": m[0], "text": m[1], "logprobs": None, "finish_reason": m[2]}]

        def chunk(m: list[str]) -> dict[str, Any]:
            return {"object": "text_completion", "id": "", "created": env.created, "choices": choices(m),
                    "model": env.model, "system_fingerprint": env.fingerprint}  # fmt: skip

        self.chunk = ChunkTemplate(chunk, 3)
        self.final = ChunkTemplate(lambda m: env.wrap("text_completion", choices(m), m[3]), 4)

    def token(self, index: int, text: str, finish_reason: str, usage_: dict[str, int] | None) -> bytes:
        """A token's chunk; with `usage_`, the prompt's last."""
        if usage_ is None:
            return self.chunk.render(index, text, finish_reason)
        return self.final.render(index, text, finish_reason, usage_)


def chat_usage_chunk(env: Envelope, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The extra last chunk sent when `stream_options.include_usage` is set."""
    return env.wrap("chat.completion.chunk", [], usage(prompt_tokens, completion_tokens))


def completion(env: Envelope, choices: list[tuple[str, str]], prompt_tokens: int, completion_tokens: int) -> dict:
    """`choices` = (text, raw finish reason) per prompt, in prompt order."""
    body = [
        {"index": i, "text": text, "logprobs": None, "finish_reason": openai_finish_reason(reason)}
        for i, (text, reason) in enumerate(choices)
    ]
    return env.wrap("text_completion", body, usage(prompt_tokens, completion_tokens))


def stream_error(message: str, status_code: int) -> dict[str, Any]:
    """The in-band error event of the OpenAI streams (HTTP status stays 200)."""
    return {"error": {"message": message, "http_status_code": status_code}}


def models_list(model_id: str, adapters: Sequence[str]) -> dict[str, Any]:
    """TGI's one entry for the model, then one per loaded LoRA adapter (the `model` values that select one)."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": model_id} for name in (model_id, *adapters)],
    }
