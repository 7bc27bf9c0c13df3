"""`Client` (blocking) and `AsyncClient` (asyncio) for a textgen / TGI server, both on httpx.

`generate` and `generate_stream` post to the base URL itself (the `/` compat route) exactly like TGI's
client; `chat` and `completion` use the OpenAI-compatible routes. Any non-200 answer or in-band stream error
raises the `textgen_client.errors` exception matching its `error_type` / status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx

from textgen_client.payloads import (
    DONE,
    chat_body,
    completion_body,
    error_from_body,
    generate_body,
    parse_event,
    parse_sse_line,
)
from textgen_client.types import (
    ChatComplete,
    ChatCompletionChunk,
    ChatMessage,
    Completion,
    Response,
    StreamResponse,
)


class _Base:
    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        cookies: dict[str, str] | None = None,
        timeout: float = 10,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = headers
        self.cookies = cookies
        self.timeout = timeout

    def _url(self, route: str) -> str:
        # The compat route `/` is the base URL itself (TGI's client posts there, not to /generate).
        return self.base_url + route if route else self.base_url


class Client(_Base):
    """Blocking client; one HTTP connection per call."""

    def _http(self) -> httpx.Client:
        return httpx.Client(headers=self.headers, cookies=self.cookies, timeout=self.timeout)

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        with self._http() as http:
            resp = http.post(self._url(route), json=body)
        if resp.status_code != 200:
            raise error_from_body(resp.status_code, resp.content)
        return resp.json()

    def _stream(self, route: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._http() as http, http.stream("POST", self._url(route), json=body) as resp:
            if resp.status_code != 200:
                raise error_from_body(resp.status_code, resp.read())
            for line in resp.iter_lines():
                payload = parse_sse_line(line)
                if payload is DONE:
                    return
                if payload is not None:
                    yield payload  # type: ignore[misc]

    def generate(self, prompt: str, **parameters: Any) -> Response:
        """Generate text; `parameters` as TGI's client (max_new_tokens=20, do_sample=False, ...)."""
        payload = self._post("", generate_body(prompt, False, **parameters))
        return Response.model_validate(payload[0])

    def generate_stream(self, prompt: str, **parameters: Any) -> Iterator[StreamResponse]:
        for payload in self._stream("", generate_body(prompt, True, **parameters)):
            yield parse_event(StreamResponse, payload)

    def chat(
        self, messages: Sequence[ChatMessage], stream: bool = False, **kwargs: Any
    ) -> ChatComplete | Iterator[ChatCompletionChunk]:
        """Chat completion; `stream=True` returns `chat_stream(...)` as TGI's client does."""
        if stream:
            return self.chat_stream(messages, **kwargs)
        return ChatComplete.model_validate(self._post("/v1/chat/completions", chat_body(messages, False, **kwargs)))

    def chat_stream(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Iterator[ChatCompletionChunk]:
        for payload in self._stream("/v1/chat/completions", chat_body(messages, True, **kwargs)):
            yield parse_event(ChatCompletionChunk, payload)

    def completion(
        self, prompt: str | list[str], stream: bool = False, **kwargs: Any
    ) -> Completion | Iterator[Completion]:
        if stream:
            return self.completion_stream(prompt, **kwargs)
        return Completion.model_validate(self._post("/v1/completions", completion_body(prompt, False, **kwargs)))

    def completion_stream(self, prompt: str | list[str], **kwargs: Any) -> Iterator[Completion]:
        for payload in self._stream("/v1/completions", completion_body(prompt, True, **kwargs)):
            yield parse_event(Completion, payload)


class AsyncClient(_Base):
    """asyncio client; a fresh httpx.AsyncClient per call so it is safe across event loops."""

    def _http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(headers=self.headers, cookies=self.cookies, timeout=self.timeout)

    async def _post(self, route: str, body: dict[str, Any]) -> Any:
        async with self._http() as http:
            resp = await http.post(self._url(route), json=body)
        if resp.status_code != 200:
            raise error_from_body(resp.status_code, resp.content)
        return resp.json()

    async def _stream(self, route: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with self._http() as http, http.stream("POST", self._url(route), json=body) as resp:
            if resp.status_code != 200:
                raise error_from_body(resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                payload = parse_sse_line(line)
                if payload is DONE:
                    return
                if payload is not None:
                    yield payload  # type: ignore[misc]

    async def generate(self, prompt: str, **parameters: Any) -> Response:
        payload = await self._post("", generate_body(prompt, False, **parameters))
        return Response.model_validate(payload[0])

    async def generate_stream(self, prompt: str, **parameters: Any) -> AsyncIterator[StreamResponse]:
        async for payload in self._stream("", generate_body(prompt, True, **parameters)):
            yield parse_event(StreamResponse, payload)

    async def chat(
        self, messages: Sequence[ChatMessage], stream: bool = False, **kwargs: Any
    ) -> ChatComplete | AsyncIterator[ChatCompletionChunk]:
        if stream:
            return self.chat_stream(messages, **kwargs)
        body = chat_body(messages, False, **kwargs)
        return ChatComplete.model_validate(await self._post("/v1/chat/completions", body))

    async def chat_stream(self, messages: Sequence[ChatMessage], **kwargs: Any) -> AsyncIterator[ChatCompletionChunk]:
        async for payload in self._stream("/v1/chat/completions", chat_body(messages, True, **kwargs)):
            yield parse_event(ChatCompletionChunk, payload)

    async def completion(
        self, prompt: str | list[str], stream: bool = False, **kwargs: Any
    ) -> Completion | AsyncIterator[Completion]:
        if stream:
            return self.completion_stream(prompt, **kwargs)
        body = completion_body(prompt, False, **kwargs)
        return Completion.model_validate(await self._post("/v1/completions", body))

    async def completion_stream(self, prompt: str | list[str], **kwargs: Any) -> AsyncIterator[Completion]:
        async for payload in self._stream("/v1/completions", completion_body(prompt, True, **kwargs)):
            yield parse_event(Completion, payload)
