"""One answered request's spans, built after the fact from the times it recorded.

The request span is the caller's child where a ``traceparent`` came in. Under it: ``tokenize``,
``queue_wait``, one ``batch`` per forward pass that ran any of its inputs, ``postprocess``
(the outputs shaped and the answer encoded) and ``answer`` (the answer written out).

A forward pass runs the items of many requests at once; each of those requests' traces gets
a ``batch`` span of its own for it, with the same times and attributes (its size, tokens and
number): a trace holds everything its request waited for, and the pass's number ties the
copies together across traces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, set_span_in_context


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """Where one request's HTTP exchange stood, in ``time.perf_counter()`` seconds, and
    the wall-clock time (``time.time_ns()``) of its start."""

    start_ns: int
    start_s: float
    end_s: float
    response_start_s: float | None
    response_end_s: float | None


def request_spans(
    tracer: Tracer, *, name: str, parent: Context, times: RequestTimes, status: int,
    method: str, path: str, state: dict[str, Any],
) -> None:  # fmt: skip
    """Send ``name``'s request span and its children (``state``: the request's, as the
    routes left it: its ``trace``, ``model``, ``request_id``, ``error_type``)."""

    def ns(seconds: float) -> int:
        return times.start_ns + round((seconds - times.start_s) * 1e9)

    trace = state.get("trace")
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "url.path": path,
        "http.response.status_code": status,
        "batchfit.request_id": state.get("request_id", ""),
    }
    if "model" in state:
        attributes["batchfit.model"] = state["model"]
    if trace is not None:
        attributes |= {
            "batchfit.inputs": trace.inputs,
            "batchfit.tokens": trace.tokens,
            "batchfit.cache_hits": trace.cache_hits,
        }
    if status >= 400:
        attributes["error.type"] = state.get("error_type") or str(status)
    span = tracer.start_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes,
        start_time=times.start_ns,
    )  # fmt: skip
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, state.get("error_type") or None))
    inside = set_span_in_context(span)

    def child(
        child_name: str, start_s: float, end_s: float, extra: dict[str, Any] | None = None
    ) -> None:
        started = ns(start_s)
        tracer.start_span(child_name, context=inside, attributes=extra, start_time=started).end(
            end_time=max(ns(end_s), started)
        )

    called_s = getattr(trace, "called_s", None)
    if called_s is not None:
        admitted_s = called_s
        if trace.tokenize_s is not None:
            admitted_s += trace.tokenize_s
            child("tokenize", called_s, admitted_s)
        if trace.queue_wait_s is not None:
            child("queue_wait", admitted_s, admitted_s + trace.queue_wait_s)
        for batch in trace.batches:
            started_s = admitted_s + batch.start_after_s
            child("batch", started_s, started_s + batch.duration_s, {
                "batchfit.batch.size": batch.size,
                "batchfit.batch.tokens": batch.tokens,
                "batchfit.batch.padded_tokens": batch.padded_tokens,
                "batchfit.batch.number": batch.number,
            })  # fmt: skip
        if trace.answered_s is not None and times.response_start_s is not None:
            child("postprocess", trace.answered_s, times.response_start_s)
    if times.response_start_s is not None:
        child("answer", times.response_start_s, times.response_end_s or times.end_s)
    span.end(end_time=ns(times.end_s))
