"""ErrorMapping around a servicer on a real grpc.aio server and unix socket: status mapping and fatal shutdown."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from textgen_pb import generate_pb2 as pb
from textgen_pb import generate_pb2_grpc
from textgen_server.cache import BatchNotFoundError
from textgen_server.interceptor import ErrorMapping, wrap_rpcs


class Failing(generate_pb2_grpc.TextGenerationServiceServicer):
    """Each RPC fails the way a layer below the servicer would."""

    async def Health(self, request: pb.HealthRequest, context: object) -> pb.HealthResponse:
        raise RuntimeError("device lost")

    async def Info(self, request: pb.InfoRequest, context: object) -> pb.InfoResponse:
        raise ValueError("bad value")

    async def ClearCache(self, request: pb.ClearCacheRequest, context: object) -> pb.ClearCacheResponse:
        raise BatchNotFoundError(7)

    async def ServiceDiscovery(self, request: object, context: object) -> pb.ServiceDiscoveryResponse:
        raise KeyError("some bug")


@pytest.mark.parametrize(
    "method, request_message, code, message, fatal",
    [
        ("Health", pb.HealthRequest(), grpc.StatusCode.INTERNAL, "device lost", True),
        ("Info", pb.InfoRequest(), grpc.StatusCode.INVALID_ARGUMENT, "bad value", False),
        ("ClearCache", pb.ClearCacheRequest(), grpc.StatusCode.NOT_FOUND, "Batch ID 7 not found in cache.", False),
        ("ServiceDiscovery", pb.ServiceDiscoveryRequest(), grpc.StatusCode.INTERNAL, "some bug", False),
    ],
)
def test_errors_map_to_status_and_runtime_error_shuts_down(
    method: str, request_message: object, code: grpc.StatusCode, message: str, fatal: bool
) -> None:
    shutdowns: list[bool] = []

    async def scenario() -> grpc.aio.AioRpcError:
        path = f"/tmp/tg-icpt-{uuid.uuid4().hex[:8]}"
        servicer = Failing()
        wrap_rpcs(servicer, ErrorMapping(lambda: shutdowns.append(True)))
        server = grpc.aio.server()
        generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
                stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await getattr(stub, method)(request_message, timeout=10)
                return err.value
        finally:
            await server.stop(grace=None)

    error = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert error.code() == code
    assert message in error.details()
    assert shutdowns == ([True] if fatal else [])
