"""OpenTelemetry for the router, as TGI sets it up when `--otlp-endpoint` is given.

- W3C trace-context propagation: an incoming `traceparent` header becomes the parent of the request's
  span, and the sharded client injects the current context into every shard call's gRPC metadata.
- Spans are exported over OTLP/gRPC in batches, with resource `service.name` = --otlp-service-name,
  sampled always. Without an endpoint no provider is installed and spans cost nothing.
- Spans: one per handler (`generate`, `generate_stream`, `compat_generate`, `tokenize`, `health`, ...),
  a `validate` child; the inference side adds its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

tracer = trace.get_tracer("textgen_router")


def setup_tracing(
    otlp_endpoint: str | None, service_name: str, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """Install the W3C propagator and, with an endpoint (or an explicit exporter, for tests), a provider.

    An explicit exporter is flushed span by span so tests see spans as soon as they end.
    Returns the provider (call `shutdown()` on it at exit to flush), or None when tracing is off.
    """
    propagate.set_global_textmap(TraceContextTextMapPropagator())
    if otlp_endpoint is None and exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=ALWAYS_ON)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not otlp_endpoint.startswith("https://")
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure)))
    trace.set_tracer_provider(provider)
    return provider


def incoming_context(headers: Mapping[str, str]) -> Context:
    """The trace context of an incoming request's `traceparent` (invalid or absent: a new trace)."""
    return propagate.extract(carrier=dict(headers))


def start_request_span(name: str, headers: Mapping[str, str]) -> Span:
    """A SERVER span for a handler, child of the caller's `traceparent` if any; the caller ends it."""
    return tracer.start_span(name, context=incoming_context(headers), kind=SpanKind.SERVER)


@contextmanager
def request_span(name: str, headers: Mapping[str, str]) -> Iterator[Span]:
    """`start_request_span`, current for the block and ended after it."""
    span = start_request_span(name, headers)
    with trace.use_span(span, end_on_exit=True):
        yield span
