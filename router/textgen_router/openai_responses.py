"""Response bodies and stream chunks of the OpenAI-compatible routes, as ordered dicts in TGI's field order.

Finish reasons: chat (both modes) and non-stream completions report `eos_token` as `stop`; completion stream
chunks carry the raw reason (`eos_token`) and `""` until a prompt's last token (a TGI quirk kept on purpose).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from textgen_router.types import Token


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

    def wrap(self, obj: str, choices: list[dict[str, Any]], usage_: dict[str, int] | None) -> dict[str, Any]:
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
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": openai_finish_reason(finish_reason),
    }
    return env.wrap("chat.completion", [choice], usage(prompt_tokens, completion_tokens))


def chat_chunk(
    env: Envelope, token: Token, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    """One token of a chat stream; special tokens (e.g. the final eos) stream as empty content."""
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": "" if token.special else token.text},
        "logprobs": logprobs,
        "finish_reason": None if finish_reason is None else openai_finish_reason(finish_reason),
    }
    return env.wrap("chat.completion.chunk", [choice], None)


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


def completion_chunk(
    env: Envelope, index: int, text: str, finish_reason: str, usage_: dict[str, int] | None
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return env.wrap("text_completion", [choice], usage_)


def stream_error(message: str, status_code: int) -> dict[str, Any]:
    """The in-band error event of the OpenAI streams (HTTP status stays 200)."""
    return {"error": {"message": message, "http_status_code": status_code}}


def models_list(model_id: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": model_id}]}
