"""Fixtures for the shard tests: the in-process transformers oracle and a real OTLP collector.

The real shard processes come from testing.shards (`ShardProcess`) and the shared `start_shard` fixture.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from shard_helpers import HFOracle


@pytest.fixture(scope="session")
def llama_oracle(tiny_llama: Path) -> HFOracle:
    return HFOracle(tiny_llama)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace collector on loopback that keeps every span it receives."""

    def __init__(self) -> None:
        self.spans: list[object] = []
        self.received = threading.Condition()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: object) -> object:
        with self.received:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
            self.received.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout: float = 20.0) -> list[object]:  # type: ignore[no-untyped-def]
        with self.received:
            self.received.wait_for(lambda: any(predicate(s) for s in self.spans), timeout=timeout)
            return [s for s in self.spans if predicate(s)]


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[tuple[Collector, int]]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, port
    server.stop(grace=None)
