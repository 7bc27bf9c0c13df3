"""gRPC server interceptors: error mapping (every RPC) and OpenTelemetry spans (when --otlp-endpoint is set).

Error contract with the router: an unknown batch id answers NOT_FOUND, bad input INVALID_ARGUMENT, anything
else INTERNAL, each with `str(error)` as the message. A RuntimeError is treated as a broken device (as TGI
does): after answering, the shard shuts itself down so the launcher notices and stops the group.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from textgen_server.cache import BatchNotFoundError

logger = logging.getLogger("textgen_server.interceptor")

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class UnaryInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the behaviour of every unary-unary RPC (all of generate.v3's) with `wrap`."""

    @abstractmethod
    def wrap(self, inner: Handler, details: grpc.HandlerCallDetails) -> Handler:
        """The behaviour to run instead of `inner` for the RPC `details.method`."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self.wrap(handler.unary_unary, details),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def status_for(error: Exception) -> grpc.StatusCode:
    if isinstance(error, BatchNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class ExceptionInterceptor(UnaryInterceptor):
    """Logs each failed RPC once and answers it with the mapped status; RuntimeError stops the shard."""

    def __init__(self, shutdown: Callable[[], None]) -> None:
        self.shutdown = shutdown

    def wrap(self, inner: Handler, details: grpc.HandlerCallDetails) -> Handler:
        method = details.method.rsplit("/", 1)[-1]

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


class TracingInterceptor(UnaryInterceptor):
    """One SERVER span per RPC, child of the W3C `traceparent` the router sends as gRPC metadata."""

    def __init__(self) -> None:
        self.tracer = trace.get_tracer("textgen_server")
        self.propagator = TraceContextTextMapPropagator()

    def wrap(self, inner: Handler, details: grpc.HandlerCallDetails) -> Handler:
        carrier = {key: value for key, value in (details.invocation_metadata or ()) if isinstance(value, str)}
        parent = self.propagator.extract(carrier)
        method = details.method

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self.tracer.start_as_current_span(
                method,
                context=parent,
                kind=trace.SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.method": method.rsplit("/", 1)[-1]},
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
