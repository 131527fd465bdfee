"""OpenTelemetry spans: exported by OTLP (HTTP) when an endpoint is configured, off otherwise.

The standard variables configure it (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_BSP_*`); without an endpoint the
API's no-op tracer is used and nothing is recorded. Spans of one request:
the master's `request`, one `stage S` per stage attempt (a re-dispatch after
a replica loss is a new attempt), and in the stage's process `process S`
under its attempt, with one `transfer S->T` per route (bytes, chunks,
transport). The trace context crosses processes as a W3C `traceparent` in
the Dispatch message.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# The tracer once setup() has found an endpoint. Until then start() hands out the API's no-op span itself,
# where the API would look up its provider (an environment read) and make a tracer for every span.
_tracer: trace.Tracer | None = None


def setup(service: str, instance: str) -> bool:
    """Export this process's spans when an OTLP endpoint is configured; whether it is."""
    if not any(os.environ.get(v) for v in ENDPOINT_VARS):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service, "service.instance.id": instance}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # what is still batched leaves on a clean exit
    global _tracer
    _tracer = trace.get_tracer("omnifleet")
    return True


def start(name: str, parent: Span | context.Context | None = None, attributes: dict[str, Any] | None = None,
          server: bool = False) -> Span:
    """A span under parent (a span, or a context from `extract`); a no-op span while nothing exports."""
    if _tracer is None:
        return trace.INVALID_SPAN
    ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    return _tracer.start_span(name, context=ctx, attributes=attributes, kind=kind)


def end(span: Span | None, error: str | None = None) -> None:
    if span is None or not span.is_recording():
        return
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def traceparent(span: Span) -> str:
    """The W3C traceparent of span ("" when it is not recorded)."""
    carrier: dict[str, str] = {}
    if span.get_span_context().is_valid:
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def extract(value: str) -> context.Context | None:
    return _PROPAGATOR.extract({"traceparent": value}) if value else None
