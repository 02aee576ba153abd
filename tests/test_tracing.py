"""Tracing's parts: what a request's trace records, the spans built from it (in memory), the
endpoint's URL, that a replica without ``--otlp-endpoint`` never loads the OpenTelemetry SDK,
and a rerank's spans and timing headers from a tiny cross-encoder served in-process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, TraceFlags, set_span_in_context
from opentelemetry.trace.span import NonRecordingSpan, SpanContext
from pydantic import ValidationError

from batching import BatchRun, Pending
from models import ModelSpec, load_model
from models.testing import save_tiny_model
from server.runtime import RequestTrace
from server.settings import Settings
from server.tracing import request_spans, traces_url
from server.tracing.spans import RequestTimes
from tests.inprocess import serve_in_thread
from tests.otlp import attributes, otlp_receiver
from tests.servers import ROOT

STEPS = ("tokenize", "queue", "inference")


def pending(arrival_s: float, cost: int) -> Pending:
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
    finally:
        loop.close()
    return Pending(item=SimpleNamespace(cost=cost), future=future, arrival_s=arrival_s,
                   deadline_s=arrival_s + 60)  # fmt: skip


def traced_request() -> RequestTrace:
    """Admitted at 10.0 s: two inputs ran in pass 3 (10.5 to 10.75 s), one in pass 4 (11.0 to
    11.5 s); a third pass (5) failed and is left out."""
    first, second = BatchRun(3, 8, 60, 80, 10.5, 10.75), BatchRun(4, 2, 12, 16, 11.0, 11.5)
    pendings = [pending(10.0, 7), pending(10.0, 5), pending(10.0, 3), pending(10.0, 4)]
    for item, run in zip(pendings, (first, first, second, BatchRun(5, 1, 4, 4, 11.0)), strict=True):
        item.started_s, item.run, item.batch = run.started_s, run, (run.number, run.size)
    trace = RequestTrace(tokenize_s=0.002)
    trace.record(pendings[:3], 10.0)
    return trace


def test_a_trace_records_each_pass_that_ran_its_inputs_once():
    trace = traced_request()
    assert trace.queue_wait_s == 1.0
    assert [(b.number, b.size, b.tokens, b.padded_tokens) for b in trace.batches] == [
        (3, 8, 60, 80), (4, 2, 12, 16),
    ]  # fmt: skip
    assert [(b.start_after_s, b.duration_s) for b in trace.batches] == [(0.5, 0.25), (1.0, 0.5)]
    assert trace.inference_s == 0.75
    assert dict(trace.timing_headers()) == {
        b"x-batchfit-tokenize-time": b"2.000",
        b"x-batchfit-queue-time": b"1000.000",
        b"x-batchfit-inference-time": b"750.000",
    }


def test_request_spans_place_the_recorded_times_under_the_callers_span():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    caller = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1))
    trace = traced_request()
    trace.called_s, trace.answered_s = 100.0, 101.6
    # The request came in at 99.9 s (perf_counter), which was 5 s after the epoch's start.
    times = RequestTimes(5_000_000_000, 99.9, 101.8, 101.7, 101.75)
    request_spans(
        provider.get_tracer("test"), name="POST /v1/infer",
        parent=set_span_in_context(NonRecordingSpan(caller)), times=times, status=200,
        method="POST", path="/v1/infer", state={"trace": trace, "request_id": "r1", "model": "m"},
    )  # fmt: skip
    spans = {span.name: span for span in exporter.get_finished_spans() if span.name != "batch"}
    batches = [span for span in exporter.get_finished_spans() if span.name == "batch"]
    request = spans.pop("POST /v1/infer")
    assert request.parent.span_id == 0xDEF and request.context.trace_id == 0xABC
    assert request.kind is SpanKind.SERVER
    assert request.attributes["batchfit.model"] == "m"
    assert (request.start_time, request.end_time) == (5_000_000_000, 6_900_000_000)
    # Admitted once tokenized: 100.002 s; its passes start 0.5 and 1.0 s after that.
    ms = 1_000_000
    expected = {
        "tokenize": (5100, 5102),
        "queue_wait": (5102, 6102),
        "postprocess": (6700, 6800),
        "answer": (6800, 6850),
    }
    assert {name: (s.start_time // ms, s.end_time // ms) for name, s in spans.items()} == expected
    assert [(s.start_time // ms, s.end_time // ms) for s in batches] == [(5602, 5852), (6102, 6602)]
    assert dict(batches[0].attributes) == {
        "batchfit.batch.size": 8, "batchfit.batch.tokens": 60,
        "batchfit.batch.padded_tokens": 80, "batchfit.batch.number": 3,
    }  # fmt: skip
    for span in [*spans.values(), *batches]:
        assert span.parent.span_id == request.context.span_id


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://otel.example/custom/traces", "https://otel.example/custom/traces"),
    ],
)
def test_the_traces_url(endpoint, url):
    assert traces_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4318", "grpc://collector:4317", "http://"])
def test_an_endpoint_that_is_no_http_url_is_refused(endpoint):
    with pytest.raises(ValidationError, match="otlp_endpoint must be an http"):
        Settings(otlp_endpoint=endpoint)


LOADED = """
import sys
from server.app import create_app
from server.settings import Settings
app = create_app(Settings(**({"otlp_endpoint": sys.argv[1]} if sys.argv[1:] else {})))
print(sorted({m for m in sys.modules if m.startswith(("opentelemetry.sdk",
                                                      "opentelemetry.exporter"))})[:1])
"""


@pytest.mark.parametrize(("args", "loaded"), [((), "[]"), (("http://127.0.0.1:9",), "['")])
def test_the_sdk_is_loaded_only_with_an_endpoint(args, loaded):
    done = subprocess.run([sys.executable, "-c", LOADED, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    assert done.stdout.startswith(loaded), done.stdout + done.stderr


def test_a_rerank_is_traced_and_timed(tmp_path):
    """A tiny real cross-encoder on real uvicorn: its documents' pass in the rerank's trace,
    and the timing headers on its answer."""
    folder = save_tiny_model(tmp_path, task="rerank", seed=3)
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    documents = ["Cats eat fish.", "The market fell.", "Dogs chase cats."]
    model = load_model(ModelSpec(model=str(folder), device="cpu"))
    with otlp_receiver() as receiver:
        with serve_in_thread(model, otlp_endpoint=receiver.url) as live:
            answer = httpx.post(
                f"{live.url}/v1/rerank", json={"query": "what do cats eat", "documents": documents},
                headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}, timeout=30,
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
        spans = [s for s in receiver.spans if s.trace_id.hex() == trace_id]
    (request,) = [s for s in spans if s.name == "POST /v1/rerank"]
    assert request.parent_span_id.hex() == parent_id
    batches = [attributes(s) for s in spans if s.name == "batch"]
    assert sum(tags["batchfit.batch.size"] for tags in batches) == len(documents)
    times = [float(answer.headers[f"x-batchfit-{step}-time"]) for step in STEPS]
    assert all(value >= 0 for value in times) and times[2] > 0, times
