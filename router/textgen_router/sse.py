"""Server-sent events exactly as TGI writes them (axum's Sse).

Each event is `data:<json>\\n\\n` (no space after the colon, no event names, no [DONE] for the native
stream); after 15 s without an event a keep-alive comment `:\\n\\n` is sent. Responses carry
`content-type: text/event-stream`, `cache-control: no-cache` and `x-accel-buffering: no`.
Used by the native and OpenAI routes: `EventStream(events, headers)` where events are bytes made with
`event(...)`, or `EventStream(make_events, headers)` where `make_events(write)` gets the stream's ChunkWriter.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

KEEP_ALIVE = b":\n\n"
KEEP_ALIVE_INTERVAL = 15.0
# Scope key under which an app may hand EventStream the ASGI server's own `send` (see EventStream). That
# `send` must only ever wait (for the client to read: flow control) before it writes anything, as uvicorn's does.
DIRECT_SEND = "textgen.direct_send"
DirectSend = Callable[[Message], Coroutine[Any, Any, None]]
"""What an app puts under DIRECT_SEND: the server's `send`, a coroutine function (uvicorn's `async def send`)."""

ChunkWriter = Callable[[bytes], bool]
"""Sends one chunk of a streaming EventStream's body at once, from any code on the event loop (the batching
loop writes the streamed tokens with it). False, with nothing sent, when it cannot: the client is not reading
fast enough, the stream is over, or the app gave no DIRECT_SEND. The chunk must then come from the source."""


async def client_disconnected(receive: Receive) -> None:
    """Return once the client has gone away: after the request body was read, the next ASGI message is the
    disconnect (or, for a finished response, nothing further matters)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def event(data: bytes) -> bytes:
    """One SSE event holding `data` (already-encoded JSON, or a literal such as b"[DONE]")."""
    return b"data:" + data + b"\n\n"


class EventStream(Response):
    """A 200 event stream whose body is `source`'s chunks, sent as they come, plus keep-alives.

    ASGI contract: the body is sent from the task that runs the response (the request's task), which also
    iterates `source`; so `source` may hold context (an OpenTelemetry span, any contextvar) across its
    awaits, and is always closed in that task. Per chunk this costs one `send`, with no hand-over to another
    task. A `source` made by a callable gets the stream's ChunkWriter, with which other code on the loop may
    send chunks in between, without waking the request's task. Around it, for the whole stream:
    - a watcher task awaits `receive()`: when the client disconnects it cancels the request's task while it
      streams, which closes `source` (the generation leaves its batch at the next step), and the response
      then ends normally;
    - one timer, re-armed only when it fires, sends KEEP_ALIVE (from a short task of its own) once
      `keep_alive_interval` seconds passed without a chunk.
    An error raised by `source` propagates, as from any ASGI app once the response has started.

    The start and the end of the response go through `send`. The chunks go through `scope[DIRECT_SEND]`
    when the app put the server's own `send` there, promising that no layer in between changes a body
    message once the response started (starlette's and FastAPI's only watch the start and the end): the
    chain of send wrappers, run once per chunk, was a sizeable share of the router's CPU under 64 streams
    (benchmark/README.md, "Router figures").
    """

    def __init__(
        self,
        source: AsyncGenerator[bytes, None] | Callable[[ChunkWriter], AsyncGenerator[bytes, None]],
        headers: Mapping[str, str],
        keep_alive_interval: float = KEEP_ALIVE_INTERVAL,
    ) -> None:
        self.source = source
        self.keep_alive_interval = keep_alive_interval
        self.status_code = 200
        self.background = None
        # Set explicitly: starlette would append "; charset=utf-8" to a text/* media type.
        all_headers = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
        all_headers.update(headers)
        self.init_headers(all_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = _Body(scope.get(DIRECT_SEND), send, self.keep_alive_interval)
        await body.stream(self.source(body.write_now) if callable(self.source) else self.source, receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Body:
    """The body of one EventStream while it streams (see EventStream for the contract)."""

    def __init__(self, direct_send: DirectSend | None, send: Send, interval: float) -> None:
        self._direct_send = direct_send
        self._send: Send = direct_send or send
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()  # when a chunk (or keep-alive) was last sent
        self._timer = self._loop.call_at(self._last + interval, self._tick)
        self._keep_alive: asyncio.Task[None] | None = None
        self._streaming = False
        self._client_left = False

    async def stream(self, source: AsyncGenerator[bytes, None], receive: Receive) -> None:
        """Send every chunk of `source`; returns early, `source` closed, when the client disconnects."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(self._watch(receive, task))
        self._streaming = True
        try:
            async with contextlib.aclosing(source):
                async for chunk in source:
                    await self._send({"type": "http.response.body", "body": chunk, "more_body": True})
                    self._last = self._loop.time()
        except asyncio.CancelledError:
            if not self._client_left:
                raise  # cancelled from outside (server shutdown)
            task.uncancel()
        finally:
            # No await before this: the watcher must not cancel the task once it left the try block.
            self._streaming = False
            watcher.cancel()
            self._timer.cancel()
            if self._keep_alive is not None:
                # Its send must not come after the final message of the response.
                self._keep_alive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._keep_alive

    def write_now(self, chunk: bytes) -> bool:
        """The stream's ChunkWriter: drives the server's `send` coroutine by hand, and drops it unsent if it
        would wait (see DIRECT_SEND)."""
        if self._direct_send is None or not self._streaming:
            return False
        # A coroutine (DIRECT_SEND is uvicorn's `async def send`): one step runs it to the end unless it waits.
        sending = self._direct_send({"type": "http.response.body", "body": chunk, "more_body": True})
        try:
            sending.send(None)
        except StopIteration:
            self._last = self._loop.time()
            return True
        sending.close()
        return False

    async def _watch(self, receive: Receive, task: asyncio.Task[None]) -> None:
        await client_disconnected(receive)
        if self._streaming:
            self._client_left = True
            task.cancel()

    async def _send_keep_alive(self) -> None:
        await self._send({"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True})

    def _tick(self) -> None:
        now = self._loop.time()
        if now >= self._last + self._interval and (self._keep_alive is None or self._keep_alive.done()):
            self._last = now
            self._keep_alive = self._loop.create_task(self._send_keep_alive())
        self._timer = self._loop.call_at(max(now, self._last) + self._interval, self._tick)
