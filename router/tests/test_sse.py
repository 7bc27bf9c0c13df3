"""/generate_stream over the shared real router: SSE bytes, errors as events, overload, client disconnects."""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from router_fixtures import MAX_CONCURRENT_REQUESTS, MAX_TOTAL_TOKENS, metric

from textgen_router.sse import DIRECT_SEND, KEEP_ALIVE, ChunkWriter, EventStream, event

pytestmark = pytest.mark.timeout(180)

PROMPT = "Hello world, this is"
NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"


def stream(client: httpx.Client, inputs: str = PROMPT, **parameters: object) -> httpx.Response:
    return client.post("/generate_stream", json={"inputs": inputs, "parameters": parameters})


def test_stream_bytes(client: httpx.Client) -> None:
    reference = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True}})
    tokens = reference.json()["details"]["tokens"]
    response = stream(client, max_new_tokens=3, details=True)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["x-compute-type"] == "gpu+optimized"
    assert response.headers["x-compute-characters"] == str(len(PROMPT))
    raw = response.content
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and len(events) == 4  # three events, each ended by a blank line, nothing after
    # The logprob digits are the shortest that give back the f32 (serde_json/ryu), taken from /generate's body.
    logprobs = re.findall(rf'"logprob":({NUMBER})', reference.text)
    prompt_tokens = reference.headers["x-prompt-tokens"]
    for i, (tok, logprob) in enumerate(zip(tokens, logprobs, strict=True), start=1):
        token = '{"id":%d,"text":%s,"logprob":%s,"special":false}' % (
            tok["id"],
            json.dumps(tok["text"], ensure_ascii=False),
            logprob,
        )
        if i < 3:
            expected = '{"index":%d,"token":%s,"generated_text":null,"details":null}' % (i, token)
        else:
            text = json.dumps(reference.json()["generated_text"], ensure_ascii=False)
            expected = (
                '{"index":3,"token":%s,"generated_text":%s,"details":{"finish_reason":"length",'
                '"generated_tokens":3,"seed":null,"input_length":%s}}' % (token, text, prompt_tokens)
            )
        assert events[i - 1] == b"data:" + expected.encode()


def test_stream_top_tokens_and_full_text(client: httpx.Client) -> None:
    events = [
        json.loads(line[5:])
        for line in stream(client, max_new_tokens=2, top_n_tokens=2, return_full_text=True).text.split("\n\n")
        if line
    ]
    assert [e["index"] for e in events] == [1, 2]
    assert all(len(e["top_tokens"]) == 2 for e in events)
    assert list(events[0]) == ["index", "token", "top_tokens", "generated_text", "details"]
    assert events[-1]["generated_text"].startswith(PROMPT)
    assert events[-1]["details"] is None  # details were not asked for


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming tokens"),
        ({"best_of": 0}, "`best_of` != 1 is not supported when streaming tokens"),
        ({"decoder_input_details": True}, "`decoder_input_details` == true is not supported when streaming tokens"),
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
    ],
)
def test_errors_are_events_on_a_200_stream(client: httpx.Client, parameters: dict, message: str) -> None:
    response = stream(client, **parameters)
    assert response.status_code == 200
    expected = {"error": f"Input validation error: {message}", "error_type": "validation"}
    assert response.content == b"data:" + json.dumps(expected, separators=(",", ":")).encode() + b"\n\n"


async def _open_streams(base_url: str, headers: dict[str, str], n: int) -> None:
    """Hold `n` long streams open (first event read), check overload, then drop them mid-stream."""
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as client:
        # As long as the server allows, so no stream can end (and give its permit back) before it is dropped.
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_TOTAL_TOKENS - 16}}
        streams = []
        for _ in range(n):
            ctx = client.stream("POST", "/generate_stream", json=body)
            response = await ctx.__aenter__()
            lines = response.aiter_lines()
            assert (await lines.__anext__()).startswith('data:{"index":1')
            streams.append((ctx, lines))
        # Every permit is taken: a new request is refused without being queued.
        overloaded = await client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1}})
        assert overloaded.status_code == 429
        assert overloaded.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        over_stream = await client.post("/generate_stream", json=body)
        assert over_stream.content == b'data:{"error":"Model is overloaded","error_type":"overloaded"}\n\n'
        for ctx, lines in streams:
            await lines.aclose()
            await ctx.__aexit__(None, None, None)


def test_overload_and_disconnect_give_permits_back(client: httpx.Client, router: object) -> None:
    dropped = metric(client, 'tgi_request_failure{err="dropped"}')
    asyncio.run(asyncio.wait_for(_open_streams(router.base_url, dict(client.headers), MAX_CONCURRENT_REQUESTS), 120))  # type: ignore[attr-defined]
    # The dropped requests leave the batch at its next step; their permits come back.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            metric(client, 'tgi_request_failure{err="dropped"}') >= dropped + MAX_CONCURRENT_REQUESTS
            and metric(client, "tgi_batch_current_size") == 0
        ):
            break
        time.sleep(0.2)
    assert metric(client, 'tgi_request_failure{err="dropped"}') == dropped + MAX_CONCURRENT_REQUESTS
    assert metric(client, "tgi_batch_current_size") == 0
    assert metric(client, 'tgi_request_failure{err="overloaded"}') >= 2
    # All permits are free again.
    for _ in range(MAX_CONCURRENT_REQUESTS + 1):
        assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1}}).status_code == 200


class AsgiPeer:
    """The server side of one EventStream call: records what is sent; `receive` reports a disconnect once
    `leave` is set (as uvicorn does once the client is gone or the response is complete)."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.leave = asyncio.Event()

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if not message.get("more_body", False) and message["type"] == "http.response.body":
            self.leave.set()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    def bodies(self) -> list[bytes]:
        assert self.sent[0]["type"] == "http.response.start" and self.sent[0]["status"] == 200
        assert self.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        return [m["body"] for m in self.sent[1:-1]]


def test_keep_alive_comment_while_idle() -> None:
    async def slow() -> AsyncIterator[bytes]:
        yield event(b"1")
        await asyncio.sleep(0.35)
        yield event(b"2")

    peer = AsgiPeer()
    asyncio.run(EventStream(slow(), {}, keep_alive_interval=0.1)({"type": "http"}, peer.receive, peer.send))
    chunks = peer.bodies()
    assert chunks[0] == b"data:1\n\n" and chunks[-1] == b"data:2\n\n"
    assert KEEP_ALIVE == b":\n\n" and 2 <= chunks.count(KEEP_ALIVE) <= 4
    assert set(chunks[1:-1]) == {KEEP_ALIVE}


def test_client_disconnect_closes_the_source_in_the_streaming_task() -> None:
    """The source is closed in the task that iterated it, so context it set across awaits is reset there."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="")
    closed: list[str] = []

    async def endless() -> AsyncIterator[bytes]:
        token = var.set("span")
        try:
            while True:
                yield b"x"
                await asyncio.sleep(0.01)
        finally:
            try:
                var.reset(token)  # ValueError if closed from another task's context
                closed.append("reset")
            except ValueError as err:
                closed.append(repr(err))

    async def main() -> None:
        peer = AsgiPeer()

        async def send(message: dict) -> None:
            await peer.send(message)
            if len(peer.sent) == 3:  # start and two chunks: the client goes away
                peer.leave.set()

        await asyncio.wait_for(EventStream(endless(), {})({"type": "http"}, peer.receive, send), 5)
        assert peer.bodies() == [b"x", b"x"]
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

    asyncio.run(main())
    assert closed == ["reset"]


def test_cancel_from_outside_propagates() -> None:
    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"x"
            await asyncio.sleep(0.01)

    async def main() -> None:
        peer = AsgiPeer()
        task = asyncio.ensure_future(EventStream(endless(), {})({"type": "http"}, peer.receive, peer.send))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_chunk_writer_sends_at_once_and_declines_what_would_wait() -> None:
    """The ChunkWriter sends through the server's own send without awaiting; a send that would wait (flow
    control) is dropped unsent, and so is every chunk once the stream is over or without DIRECT_SEND."""
    results: list[bool] = []
    writers: list[ChunkWriter] = []

    async def main() -> None:
        peer = AsgiPeer()
        readable = asyncio.Event()

        async def server_send(message: dict) -> None:  # waits for the client to read, like uvicorn's
            if message["type"] == "http.response.body" and message.get("more_body") and not readable.is_set():
                await readable.wait()
            await peer.send(message)

        def source(write: ChunkWriter) -> AsyncIterator[bytes]:
            async def events() -> AsyncIterator[bytes]:
                writers.append(write)
                readable.set()
                results.append(write(b"a"))
                readable.clear()
                results.append(write(b"b"))  # would wait: declined, so the source sends it
                readable.set()
                yield b"b"
                results.append(write(b"c"))

            return events()

        scope = {"type": "http", DIRECT_SEND: server_send}
        await asyncio.wait_for(EventStream(source, {})(scope, peer.receive, peer.send), 5)
        assert peer.bodies() == [b"a", b"b", b"c"]
        results.append(writers[0](b"late"))  # the response is complete
        plain = AsgiPeer()
        await asyncio.wait_for(EventStream(source, {})({"type": "http"}, plain.receive, plain.send), 5)
        assert plain.bodies() == [b"b"]

    asyncio.run(main())
    assert results == [True, False, True, False, False, False, False]


def test_a_client_that_reads_late_gets_every_event_in_order(client: httpx.Client) -> None:
    """A client that reads nothing until its generation is over (the tokens written from the batching loop pile
    up in the socket buffers) still gets every event, in order."""
    n = MAX_TOTAL_TOKENS - 16
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": n, "top_n_tokens": 5}}).encode()
    head = (
        f"POST /generate_stream HTTP/1.1\r\nHost: x\r\nAuthorization: {client.headers['authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connecting: a small window
        sock.settimeout(60)
        sock.connect((client.base_url.host, client.base_url.port))
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and metric(client, "tgi_batch_current_size") < 1:
            time.sleep(0.01)
        while time.monotonic() < deadline and metric(client, "tgi_batch_current_size") > 0:
            time.sleep(0.05)  # every token generated, the stream mostly unread
        raw = b""
        while chunk := sock.recv(1 << 16):
            raw += chunk
    payload = raw.split(b"\r\n\r\n", 1)[1]
    events = [json.loads(line[5:]) for line in re.findall(rb"data:[^\n]*", payload)]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["generated_text"] is not None and events[-1]["details"] is None
    assert len(events) == n or events[-1]["token"]["special"]  # max_new_tokens, or an EOS token


def test_non_streaming_client_that_leaves_stops_generating(client: httpx.Client) -> None:
    dropped = metric(client, 'tgi_request_failure{err="dropped"}')
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 450}}).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: {client.headers['authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    # Leave as soon as the request is in the running batch, however fast the machine decodes its 450 tokens.
    with socket.create_connection((client.base_url.host, client.base_url.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and metric(client, "tgi_batch_current_size") < 1:
            time.sleep(0.01)
        assert metric(client, "tgi_batch_current_size") == 1

    # The drop is counted when the request's next generation comes back, and the batch's size is set to 0 only once
    # the loop has filtered the request away, an RPC later: a poll between the two saw the drop and a batch of 1.
    def settled() -> bool:
        gone = metric(client, 'tgi_request_failure{err="dropped"}') == dropped + 1
        return gone and metric(client, "tgi_batch_current_size") == 0

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not settled():
        time.sleep(0.2)
    assert metric(client, 'tgi_request_failure{err="dropped"}') == dropped + 1
    assert metric(client, "tgi_batch_current_size") == 0
