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
from collections.abc import AsyncIterator, Mapping

from starlette.responses import StreamingResponse

KEEP_ALIVE = b":\n\n"
KEEP_ALIVE_INTERVAL = 15.0


def event(data: bytes) -> bytes:
    """One SSE event holding `data` (already-encoded JSON, or a literal such as b"[DONE]")."""
    return b"data:" + data + b"\n\n"


async def with_keep_alive(source: AsyncIterator[bytes], interval: float = KEEP_ALIVE_INTERVAL) -> AsyncIterator[bytes]:
    """`source`'s chunks, plus KEEP_ALIVE whenever `interval` seconds pass without one.

    `source` is drained by one task of its own, so it may hold context (an OpenTelemetry span) across
    its awaits. Closing this iterator (the client went away) cancels that task, which closes `source`.
    """
    queue: asyncio.Queue[tuple[bytes | None, BaseException | None]] = asyncio.Queue(maxsize=1)

    async def pump() -> None:
        try:
            async for chunk in source:
                await queue.put((chunk, None))
        except Exception as err:  # handed to the consumer, which re-raises it in its own task
            await queue.put((None, err))
            return
        await queue.put((None, None))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            try:
                chunk, err = await asyncio.wait_for(queue.get(), timeout=interval)
            except asyncio.TimeoutError:
                yield KEEP_ALIVE
                continue
            if err is not None:
                raise err
            if chunk is None:
                return
            yield chunk
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def sse_response(body: AsyncIterator[bytes], headers: Mapping[str, str]) -> StreamingResponse:
    """A 200 event stream with TGI's SSE headers plus `headers`."""
    # Set explicitly: starlette would append "; charset=utf-8" to a text/* media type.
    all_headers = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
    all_headers.update(headers)
    return StreamingResponse(body, headers=all_headers)
