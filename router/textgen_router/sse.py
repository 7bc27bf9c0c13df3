"""Server-sent events exactly as TGI writes them (axum's Sse).

Each event is `data:<json>\\n\\n` (no space after the colon, no event names, no [DONE] for the native
stream); after 15 s without an event a keep-alive comment `:\\n\\n` is sent. Responses carry
`content-type: text/event-stream`, `cache-control: no-cache` and `x-accel-buffering: no`.
Reused by the OpenAI routes: `sse_response(with_keep_alive(events), headers)` where events are bytes
made with `event(...)`.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Mapping

from starlette.responses import StreamingResponse

KEEP_ALIVE = b":\n\n"
KEEP_ALIVE_INTERVAL = 15.0


def event(data: bytes) -> bytes:
    """One SSE event holding `data` (already-encoded JSON, or a literal such as b"[DONE]")."""
    return b"data:" + data + b"\n\n"


class _Pipe:
    """Chunks from the pump task to the response task, with one idle timer for the keep-alive.

    Per chunk this is an append and at most one future wake-up; the timer is armed once and re-armed only
    when it fires (every `interval` at most), instead of a timeout per chunk.
    """

    def __init__(self, interval: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._interval = interval
        self._chunks: deque[bytes] = deque()
        self._end = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._last = self._loop.time()  # when a chunk (or keep-alive) was last handed out
        self._timer = self._loop.call_at(self._last + interval, self._tick)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _tick(self) -> None:
        now = self._loop.time()
        if now >= self._last + self._interval:
            self._wake()
        self._timer = self._loop.call_at(max(now, self._last) + self._interval, self._tick)

    async def drain(self, source: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in source:
                self._chunks.append(chunk)
                self._wake()
        except Exception as err:  # handed to the consumer, which re-raises it in its own task
            self._error = err
        self._end = True
        self._wake()

    async def get(self) -> bytes | None:
        """The next chunk, KEEP_ALIVE after `interval` idle seconds, None at the end; raises the source's error."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._end:
                return None
            if self._loop.time() >= self._last + self._interval:
                self._last = self._loop.time()
                return KEEP_ALIVE
            self._waiter = self._loop.create_future()
            await self._waiter
        self._last = self._loop.time()
        return self._chunks.popleft()

    def close(self) -> None:
        self._timer.cancel()


async def with_keep_alive(source: AsyncIterator[bytes], interval: float = KEEP_ALIVE_INTERVAL) -> AsyncIterator[bytes]:
    """`source`'s chunks, plus KEEP_ALIVE whenever `interval` seconds pass without one.

    `source` is drained by one task of its own, so it may hold context (an OpenTelemetry span) across
    its awaits. Closing this iterator (the client went away) cancels that task, which closes `source`.
    """
    pipe = _Pipe(interval)
    task = asyncio.ensure_future(pipe.drain(source))
    try:
        while (chunk := await pipe.get()) is not None:
            yield chunk
    finally:
        pipe.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def sse_response(body: AsyncIterator[bytes], headers: Mapping[str, str]) -> StreamingResponse:
    """A 200 event stream with TGI's SSE headers plus `headers`."""
    # Set explicitly: starlette would append "; charset=utf-8" to a text/* media type.
    all_headers = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
    all_headers.update(headers)
    return StreamingResponse(body, headers=all_headers)
