"""The floor under the router's CPU per decode step: what the kernel and grpcio cost before any of our code runs.

At batch N, every decode step of the router does at least two things that are not its own Python:
1. one socket write per stream (the token's SSE chunk, ~150 bytes) to N clients, through the kernel's TCP path
   (on loopback the writer's syscall also runs the receiver's TCP input and wake-up);
2. one generate.v3 `Decode` call over a unix socket with grpc.aio, whose answer carries N generations.

This measures both alone, in this process: the writes with plain blocking sockets to a reader process (the
cheapest way to write; the router goes through uvloop's transport), the call against a trivial grpc.aio
shard in a child process that answers a canned DecodeResponse. Each step is followed by an idle pause: a short
one is like the tiny model's steps in router_cpu.py, a long one like W1's steps on the small model,
during which the router waits for the shard. It prints the process CPU per step of each part (user+system of
every thread, grpcio's own included) and their sum: no router that streams to N clients over TCP and talks
generate.v3 through grpcio spends less.

After a long pause the same work costs more CPU. On a virtual machine whose idle vCPU halts (cpuidle
`haltpoll`), much of that is the wake-up from the halt: `--pm-qos` holds /dev/cpu_dma_latency at 0 for the
run (root only; what `tuned`'s latency-performance profile does), which keeps idle CPUs polling instead, to
show how much of the floor is that.

    python benchmark/router_floor.py [--streams 64] [--steps 300] [--pauses-ms 2,45] [--pm-qos] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from textgen_pb import generate_pb2, generate_pb2_grpc
from textgen_router.responses import stream_token_event
from textgen_router.sse import event
from textgen_router.types import Token

# A mid-stream /generate_stream event, encoded by the router's own functions, in its chunked-encoding frame.
_EVENT = event(stream_token_event(42, Token(1234, " hello", -0.53125)))
CHUNK = b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)


def decode_response(streams: int) -> generate_pb2.DecodeResponse:
    """What a shard answers for one decode step of `streams` requests (one token each, none finished)."""
    answer = generate_pb2.DecodeResponse(forward_ns=1, decode_ns=1, total_ns=2)
    for i in range(streams):
        g = answer.generations.add(request_id=i)
        g.tokens.ids.append(1234)
        g.tokens.logprobs.append(-0.53125)
        g.tokens.texts.append(" hello")
        g.tokens.is_special.append(False)
    answer.batch.CopyFrom(generate_pb2.CachedBatch(id=1, request_ids=range(streams), size=streams, max_tokens=9000))
    return answer


class _Shard(generate_pb2_grpc.TextGenerationServiceServicer):
    def __init__(self, streams: int) -> None:
        self.answer = decode_response(streams)

    async def Decode(self, request: generate_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> object:
        return self.answer


async def serve_shard(path: str, streams: int) -> None:
    server = grpc.aio.server()
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(_Shard(streams), server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def read_all(port: int, streams: int) -> None:
    """The clients: `streams` connections, each read as data arrives until the writer closes it."""
    selector = selectors.DefaultSelector()
    for _ in range(streams):
        selector.register(socket.create_connection(("127.0.0.1", port)), selectors.EVENT_READ)
    left = streams
    while left:
        for key, _ in selector.select():
            if not key.fileobj.recv(1 << 16):  # type: ignore[union-attr]
                selector.unregister(key.fileobj)
                left -= 1


def _child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)


def writes_cpu(streams: int, steps: int, pause: float) -> float:
    """Process CPU seconds per step of one CHUNK written to each of `streams` loopback TCP clients."""
    with socket.create_server(("127.0.0.1", 0), backlog=streams) as listener:
        reader = _child("--read", str(listener.getsockname()[1]), "--streams", str(streams))
        conns = [listener.accept()[0] for _ in range(streams)]
    for conn in conns:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as uvicorn sets it
    start = time.process_time()
    for _ in range(steps):
        for conn in conns:
            conn.sendall(CHUNK)
        time.sleep(pause)
    spent = time.process_time() - start
    for conn in conns:
        conn.close()
    reader.wait(timeout=60)
    return spent / steps


async def _decode_loop(path: str, streams: int, steps: int, pause: float) -> float:
    request = generate_pb2.DecodeRequest(batches=[decode_response(streams).batch])
    async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        for _ in range(20):  # connect and warm up
            await stub.Decode(request)
        start = time.process_time()
        for _ in range(steps):
            answer = await stub.Decode(request)
            assert len(answer.generations) == streams
            await asyncio.sleep(pause)
        return (time.process_time() - start) / steps


def decode_call_cpu(streams: int, steps: int, pause: float) -> float:
    """Process CPU seconds per grpc.aio Decode call answered with `streams` generations."""
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/shard"
        shard = _child("--serve", path, "--streams", str(streams))
        try:
            assert shard.stdout is not None and shard.stdout.readline().strip() == "ready"
            return asyncio.run(_decode_loop(path, streams, steps, pause))
        finally:
            shard.kill()
            shard.wait()


def hold_cpu_latency_zero() -> int:
    """Ask for no idle-state exit latency (PM QoS) until the returned descriptor is closed."""
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    os.write(fd, struct.pack("i", 0))
    return fd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pauses-ms", default="2,45", help="pause after each step, comma list")
    parser.add_argument("--pm-qos", action="store_true", help="hold /dev/cpu_dma_latency at 0 (root)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--read", type=int, help=argparse.SUPPRESS)  # child: the clients of this port
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # child: the trivial shard on this socket
    args = parser.parse_args()
    if args.read is not None:
        return read_all(args.read, args.streams)
    if args.serve is not None:
        return asyncio.run(serve_shard(args.serve, args.streams))
    if args.pm_qos:
        hold_cpu_latency_zero()  # held until this process exits
    results = []
    for pause_ms in (float(p) for p in args.pauses_ms.split(",")):
        writes = writes_cpu(args.streams, args.steps, pause_ms / 1e3)
        call = decode_call_cpu(args.streams, args.steps, pause_ms / 1e3)
        r = {
            "pause_ms": pause_ms,
            "pm_qos": args.pm_qos,
            "streams": args.streams,
            "writes_ms_per_step": writes * 1e3,
            "us_per_write": writes / args.streams * 1e6,
            "decode_call_ms_per_step": call * 1e3,
            "floor_ms_per_step": (writes + call) * 1e3,
        }
        results.append(r)
        print(
            f"pause {pause_ms:4.0f} ms: {args.streams} socket writes {r['writes_ms_per_step']:.2f} ms "
            f"({r['us_per_write']:.1f} us each) + Decode call {r['decode_call_ms_per_step']:.2f} ms "
            f"= floor {r['floor_ms_per_step']:.2f} ms of router CPU per decode step",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
