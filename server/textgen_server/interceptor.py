"""What wraps every RPC of the shard: error mapping, and OpenTelemetry spans when --otlp-endpoint is set.

Error contract with the router: an unknown batch id answers NOT_FOUND, bad input INVALID_ARGUMENT, anything
else INTERNAL, each with `str(error)` as the message. A RuntimeError is treated as a broken device (as TGI
does): after answering, the shard shuts itself down so the launcher notices and stops the group.

The wrappers replace the servicer's methods once, when the server is built, rather than being grpc.aio server
interceptors: the server awaits an interceptor chain on every call, which cost 30-45 us of a 1 ms Health round
trip on a 2-core VM (benchmark/README.md, "gRPC's floor"). A batch-1 decode step pays it on every token.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from textgen_pb import generate_pb2
from textgen_server.cache import BatchNotFoundError

logger = logging.getLogger("textgen_server.interceptor")

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
# Wraps the handler of one RPC (its full name, e.g. "/generate.v3.TextGenerationService/Health").
Wrapper = Callable[[str, Handler], Handler]

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["TextGenerationService"]


def wrap_rpcs(servicer: object, *wrappers: Wrapper) -> None:
    """Replace each generate.v3 RPC method of `servicer` (on the instance) by its wrapped form, the first wrapper
    outermost. Call it before `add_TextGenerationServiceServicer_to_server`, which reads the methods."""
    for method in SERVICE.methods:
        handler: Handler = getattr(servicer, method.name)
        for wrap in reversed(wrappers):
            handler = wrap(f"/{SERVICE.full_name}/{method.name}", handler)
        setattr(servicer, method.name, handler)


def status_for(error: Exception) -> grpc.StatusCode:
    if isinstance(error, BatchNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class ErrorMapping:
    """Logs each failed RPC once and answers it with the mapped status; RuntimeError stops the shard."""

    def __init__(self, shutdown: Callable[[], None]) -> None:
        self.shutdown = shutdown

    def __call__(self, name: str, inner: Handler) -> Handler:
        method = name.rsplit("/", 1)[-1]

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner(request, context)
            except Exception as error:  # noqa: BLE001 - every failure must become a gRPC status
                code = status_for(error)
                fatal = isinstance(error, RuntimeError) and not isinstance(error, NotImplementedError)
                if code == grpc.StatusCode.INTERNAL:
                    logger.exception("Method %s encountered an error.", method)
                else:
                    logger.error("Method %s rejected: %s", method, error)
                if fatal:
                    logger.error("Shutting down after an unrecoverable error in %s", method)
                    self.shutdown()
                await context.abort(code, str(error))

        return guarded


class Tracing:
    """One SERVER span per RPC, child of the W3C `traceparent` the router sends as gRPC metadata."""

    def __init__(self) -> None:
        self.tracer = trace.get_tracer("textgen_server")
        self.propagator = TraceContextTextMapPropagator()

    def __call__(self, name: str, inner: Handler) -> Handler:
        attributes = {"rpc.system": "grpc", "rpc.method": name.rsplit("/", 1)[-1]}

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            metadata = context.invocation_metadata() or ()
            carrier = {key: value for key, value in metadata if isinstance(value, str)}
            with self.tracer.start_as_current_span(
                name, context=self.propagator.extract(carrier), kind=trace.SpanKind.SERVER, attributes=attributes
            ):
                return await inner(request, context)

        return traced


def setup_tracing(otlp_endpoint: str, service_name: str) -> None:
    """Export spans over OTLP/gRPC to `otlp_endpoint` under `service_name` (batched, off the hot path)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
