"""A bare asyncio HTTP/1.1 client for the router's SSE routes: `sse_events` (every event of one answer, with
its arrival time) and `generate_stream` (one /generate_stream request as a `Stream` record: when it was sent and
when each token arrived). httpx took several times its CPU per event (README), on the cores the server under
test runs on (a real client runs on another machine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from urllib.parse import urlsplit


async def sse_events(host: str, port: int, path: str, body: dict) -> AsyncGenerator[tuple[float, bytes], None]:
    """POST `body` and yield (arrival time, data) per SSE event of the answer; an HTTP error raises
    RuntimeError."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST %s HTTP/1.1\r\nhost: w1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (path.encode(), len(data), data)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1].decode()
        if status != "200":
            raise RuntimeError(f"HTTP {status}: {(await reader.read())[:200]!r}")
        chunked = b"transfer-encoding: chunked" in head.lower()
        pending = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                chunk = (await reader.readexactly(size + 2))[:-2]
            else:
                size = len(chunk := await reader.read(65536))
            if not size:
                return
            now = time.perf_counter()
            *events, pending = (pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield now, line[5:].strip()
    finally:
        writer.close()


@dataclass
class Stream:
    """One /generate_stream answer as the client saw it (perf_counter seconds). Filled while it streams, so
    another task can watch `arrivals` grow."""

    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # one per non-special token event
    finish_reason: str | None = None  # from the final event's details
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None


async def generate_stream(url: str, body: dict, record: Stream | None = None) -> Stream:
    """POST `body` to `url`/generate_stream and record the answer in `record` (a new Stream if none). A
    connection or HTTP error, or an error event, ends it with `error` set; cancelling closes the connection
    (the router then drops the request)."""
    rec = record if record is not None else Stream()
    address = urlsplit(url)
    if address.hostname is None or address.port is None:
        raise ValueError(f"{url}: a server URL needs a host and a port")
    rec.sent = time.perf_counter()
    try:
        events = sse_events(address.hostname, address.port, "/generate_stream", body)
        async with contextlib.aclosing(events):
            async for now, data in events:
                payload = json.loads(data)
                if "error" in payload:
                    rec.error = str(payload["error"])
                    break
                token = payload.get("token")
                if token is not None and not token.get("special", False):
                    rec.arrivals.append(now)
                if payload.get("details"):
                    rec.finish_reason = payload["details"].get("finish_reason")
    except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as err:
        rec.error = repr(err)
    return rec
