"""`Client` (blocking) and `AsyncClient` (asyncio) for a textgen / TGI server, both on httpx.

`generate` and `generate_stream` post to the base URL itself (the `/` compat route) exactly like TGI's
client; `chat` and `completion` use the OpenAI-compatible routes. Any non-200 answer or in-band stream error
raises the `textgen_client.errors` exception matching its `error_type` / status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, cast

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
    Grammar,
    Response,
    StreamResponse,
    Tool,
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


def _arguments(values: dict[str, Any]) -> dict[str, Any]:
    """A method's arguments from its `locals()` taken first thing, for the body builder that takes the same names:
    the methods spell TGI's parameters out (a caller may pass them by position), and the sync and async clients
    forward them the same way."""
    return {name: value for name, value in values.items() if name != "self"}


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

    def generate(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int = 20,
        best_of: int | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        decoder_input_details: bool = False,
        top_n_tokens: int | None = None,
        grammar: Grammar | dict[str, Any] | None = None,
    ) -> Response:
        """Generate text: TGI's client's parameters, in its order and with its defaults."""
        body = generate_body(stream=False, **_arguments(locals()))
        return Response.model_validate(self._post("", body)[0])

    def generate_stream(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int = 20,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        top_n_tokens: int | None = None,
        grammar: Grammar | dict[str, Any] | None = None,
    ) -> Iterator[StreamResponse]:
        """Stream generated tokens: `generate`'s parameters less `best_of` and `decoder_input_details`, which a
        stream cannot have (as in TGI's client)."""
        body = generate_body(stream=True, **_arguments(locals()))
        for payload in self._stream("", body):
            yield parse_event(StreamResponse, payload)

    def chat(
        self,
        messages: Sequence[ChatMessage],
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: list[float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        stream: bool = False,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        tools: Sequence[Tool | dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        *,
        max_completion_tokens: int | None = None,
        stop: list[str] | None = None,
        stream_options: dict[str, bool] | None = None,
        tool_prompt: str | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> ChatComplete | Iterator[ChatCompletionChunk]:
        """Chat completion, or with `stream=True` an iterator of its chunks. The positional parameters are TGI's
        client's, in its order (`repetition_penalty` is refused: the chat route has none); textgen's other
        chat fields are keyword-only."""
        body = chat_body(**_arguments(locals()))
        if stream:
            return self._chat_chunks(body)
        return ChatComplete.model_validate(self._post("/v1/chat/completions", body))

    def chat_stream(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Iterator[ChatCompletionChunk]:
        """`chat(messages, stream=True, **kwargs)`, typed as the stream it returns."""
        return cast(Iterator[ChatCompletionChunk], self.chat(messages, stream=True, **kwargs))

    def _chat_chunks(self, body: dict[str, Any]) -> Iterator[ChatCompletionChunk]:
        for payload in self._stream("/v1/chat/completions", body):
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

    async def generate(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int = 20,
        best_of: int | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        decoder_input_details: bool = False,
        top_n_tokens: int | None = None,
        grammar: Grammar | dict[str, Any] | None = None,
    ) -> Response:
        """Generate text: TGI's client's parameters, in its order and with its defaults."""
        body = generate_body(stream=False, **_arguments(locals()))
        return Response.model_validate((await self._post("", body))[0])

    async def generate_stream(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int = 20,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        top_n_tokens: int | None = None,
        grammar: Grammar | dict[str, Any] | None = None,
    ) -> AsyncIterator[StreamResponse]:
        """Stream generated tokens: `generate`'s parameters less `best_of` and `decoder_input_details`, which a
        stream cannot have (as in TGI's client)."""
        body = generate_body(stream=True, **_arguments(locals()))
        async for payload in self._stream("", body):
            yield parse_event(StreamResponse, payload)

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: list[float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        stream: bool = False,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        tools: Sequence[Tool | dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        *,
        max_completion_tokens: int | None = None,
        stop: list[str] | None = None,
        stream_options: dict[str, bool] | None = None,
        tool_prompt: str | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> ChatComplete | AsyncIterator[ChatCompletionChunk]:
        """Chat completion, or with `stream=True` an async iterator of its chunks. The positional parameters are TGI's
        client's, in its order (`repetition_penalty` is refused: the chat route has none); textgen's other
        chat fields are keyword-only."""
        body = chat_body(**_arguments(locals()))
        if stream:
            return self._chat_chunks(body)
        return ChatComplete.model_validate(await self._post("/v1/chat/completions", body))

    async def chat_stream(self, messages: Sequence[ChatMessage], **kwargs: Any) -> AsyncIterator[ChatCompletionChunk]:
        """The chunks of `await chat(messages, stream=True, **kwargs)`, without the `await`."""
        chunks = cast(AsyncIterator[ChatCompletionChunk], await self.chat(messages, stream=True, **kwargs))
        async for chunk in chunks:
            yield chunk

    async def _chat_chunks(self, body: dict[str, Any]) -> AsyncIterator[ChatCompletionChunk]:
        async for payload in self._stream("/v1/chat/completions", body):
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
