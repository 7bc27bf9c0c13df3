"""Bounded request reads: uvicorn's httptools protocol with a deadline on each request's headers and body.

uvicorn bounds only the idle time between two requests on a connection that has already been answered
(`timeout_keep_alive`). A client that connects and sends nothing, stops halfway through its headers, or sends
fewer body bytes than its Content-Length announces would hold its socket, buffers and (for a body) a
handler task for as long as it likes. TGI's HTTP stack (axum on hyper) has no flag for this either; these
bounds are ours:

- headers: a new connection, and each later request from its first byte on, must finish its header block
  within `TEXTGEN_HEADER_TIMEOUT` seconds (default 10);
- body: once the request is handed to the app, its whole body must arrive within `TEXTGEN_BODY_TIMEOUT`
  seconds (default 60: the default 2 MB payload limit at ~33 kB/s).

When a deadline passes, a request that has begun and has no response yet is answered 408 `Request Timeout`
(plain text, `connection: close`); the connection is then closed. A connection that never sent a byte is
closed without a response, as hyper does: a client that sends its request at that moment must not take an
unsolicited 408 for its answer. A response in progress on the connection (pipelining) is never cut: the
header deadline of the request queued behind it starts again.
"""

from __future__ import annotations

import asyncio
import os

from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

HEADER_TIMEOUT_S = float(os.environ.get("TEXTGEN_HEADER_TIMEOUT", "10"))
BODY_TIMEOUT_S = float(os.environ.get("TEXTGEN_BODY_TIMEOUT", "60"))

_TIMEOUT_TEXT = b"Request Timeout"
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: " + str(len(_TIMEOUT_TEXT)).encode() + b"\r\n"
    b"connection: close\r\n\r\n" + _TIMEOUT_TEXT
)


class ReadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the header and body deadlines of the module docstring."""

    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    # A request's first byte has been parsed and its header block is not complete yet.
    _in_headers = False

    # Same signature as uvicorn's: the loop hands this protocol a Transport, asyncio's stub says BaseTransport.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        # Pipelined requests start here only once the one before them is answered (their reading is paused
        # until then): the body deadline counts from when the app can consume the body.
        super()._start_asgi_task(cycle, app)
        if cycle.more_body and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(BODY_TIMEOUT_S, self._body_timeout, cycle)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._header_timeout)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._responding():
            self._arm_header_timer()
            return
        self._expire("headers", answer=self._in_headers)

    def _body_timeout(self, cycle: RequestResponseCycle) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            self._expire("body", answer=not cycle.response_started)

    def _expire(self, part: str, answer: bool) -> None:
        client = "%s:%d" % self.client if self.client else "unknown client"
        self.logger.warning("Request %s not received in time from %s, closing the connection", part, client)
        if answer:
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()
