"""Tracing with OpenTelemetry, shared by the gateway and the replicas.

A request's W3C `traceparent` (and `tracestate`) is taken from the client and passed on at each
hop: gateway -> prefill worker -> decode worker -> engine, so that one trace holds the whole
request. Spans are exported only when an OTLP endpoint is set (`--otlp-traces-endpoint URL`, or
$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; OTLP over HTTP, the `otlp` extra); without one the API's
no-op tracer costs next to nothing, and the trace context still passes through each hop."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACER = "shoal"


def endpoint_from(flag: str | None) -> str | None:
    """The OTLP endpoint spans go to: the flag, else the standard variable, else none (off)."""
    return flag or os.environ.get(ENDPOINT_ENV) or None


def configure(service: str, endpoint: str | None, **resource: str) -> None:
    """Exports this process's spans to `endpoint` (OTLP/HTTP) as `service`; nothing when None."""
    if not endpoint:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise SystemExit(
            "shoal: --otlp-traces-endpoint needs the OTLP exporter: pip install 'shoal[otlp]'"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": service, **resource}))
    # A short delay: a trace is read while the request is fresh, and a replica may be stopped soon.
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=500)
    )
    trace.set_tracer_provider(provider)


def fastapi_options() -> dict:
    """FastAPI's own request spans off, in the versions that make them: shoal's carry the request
    id and role, and a second span per request would split a trace's children between two."""
    import inspect

    from fastapi import FastAPI

    return {"telemetry": {"tracing": False}} if "telemetry" in inspect.signature(FastAPI).parameters else {}


def shutdown() -> None:
    """Sends the spans still buffered (at exit)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


def incoming(headers: Mapping[str, str]) -> context.Context:
    """The trace context a request arrived with (an empty one when it came with none)."""
    return propagate.extract(headers)


def outgoing(headers: Mapping[str, str], span: Span | None = None) -> dict[str, str]:
    """`headers` with the trace context of `span` (else the current one) for the next hop."""
    out = {k: v for k, v in headers.items() if k.lower() not in ("traceparent", "tracestate")}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(out, context=ctx)
    return out


@contextlib.contextmanager
def child(name: str, parent: Span | None, **attributes) -> Iterator[Span]:
    """A span under `parent` (or the current span), current while the block runs."""
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    with tracer().start_as_current_span(name, context=ctx, attributes=attributes) as span:
        yield span


def server_span(name: str, headers: Mapping[str, str], **attributes) -> Span:
    """The span of a request this process serves, under the caller's trace context."""
    return tracer().start_span(name, context=incoming(headers), kind=SpanKind.SERVER, attributes=attributes)


def end(span: Span, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record(name: str, parent: Span, start: float, stop: float, **attributes) -> None:
    """A finished span from `start` to `stop` (time.monotonic() readings) under `parent`."""
    ctx = trace.set_span_in_context(parent)
    span = tracer().start_span(name, context=ctx, start_time=epoch_ns(start), attributes=attributes)
    span.end(end_time=epoch_ns(stop))
