"""``--otlp-endpoint``: a real replica (one process, and API processes in front of an engine)
sends each request's spans to a real OTLP/HTTP receiver, under the caller's ``traceparent``;
and every replica answers with its timing headers, traced or not."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.otlp import attributes, otlp_receiver
from tests.servers import run_server

pytestmark = pytest.mark.integration

TEXTS = [
    "The cat sits on the mat.",
    "Batching requests makes inference on accelerators much cheaper.",
    "hello",
]
CHILDREN = {"tokenize", "queue_wait", "batch", "postprocess", "answer"}
TIMING_HEADERS = ("x-batchfit-tokenize-time", "x-batchfit-queue-time", "x-batchfit-inference-time")


@pytest.fixture(scope="module", params=["one process", "api workers"])
def traced(request, tmp_path_factory):
    workers = ("--api-workers", "2") if request.param == "api workers" else ()
    with (
        otlp_receiver() as receiver,
        run_server(
            tmp_path_factory.mktemp("traced"), "--otlp-endpoint", receiver.url, *workers
        ) as server,
    ):
        server.receiver = receiver
        yield server


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("plain")) as server:
        yield server


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["models"][0]["name"]


def ids() -> tuple[str, str]:
    return os.urandom(16).hex(), os.urandom(8).hex()


def spans_of(receiver, trace_id: str) -> list[Span]:
    """The request's spans, once its request span and every child have arrived."""

    def done(spans: list[Span]) -> bool:
        names = {s.name for s in spans if s.trace_id.hex() == trace_id}
        return names >= CHILDREN and any(" /" in name for name in names)

    return [s for s in receiver.wait_for(done) if s.trace_id.hex() == trace_id]


def test_spans_continue_the_callers_trace(traced):
    trace_id, parent_id = ids()
    answer = httpx.post(
        f"{traced.url}/v1/embeddings", json={"input": TEXTS, "model": model_of(traced.url)},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}, timeout=60,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    spans = spans_of(traced.receiver, trace_id)
    assert traced.receiver.paths and set(traced.receiver.paths) == {"/v1/traces"}
    assert traced.receiver.services == {"batchfit"}

    (request,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert request.parent_span_id.hex() == parent_id
    assert request.kind == Span.SpanKind.SPAN_KIND_SERVER
    tags = attributes(request)
    assert tags["http.response.status_code"] == 200
    assert tags["batchfit.request_id"] == answer.headers["x-request-id"]
    assert tags["batchfit.inputs"] == len(TEXTS)
    children = [s for s in spans if s is not request]
    assert {s.name for s in children} <= CHILDREN
    for child in children:
        assert child.parent_span_id == request.span_id, child.name
        assert request.start_time_unix_nano <= child.start_time_unix_nano, child.name
        assert child.start_time_unix_nano <= child.end_time_unix_nano, child.name
        assert child.end_time_unix_nano <= request.end_time_unix_nano, child.name

    (tokenize,) = [s for s in children if s.name == "tokenize"]
    (queue_wait,) = [s for s in children if s.name == "queue_wait"]
    (answered,) = [s for s in children if s.name == "answer"]
    batches = sorted(
        (s for s in children if s.name == "batch"), key=lambda s: s.start_time_unix_nano
    )
    assert tokenize.end_time_unix_nano <= queue_wait.start_time_unix_nano
    assert batches[0].start_time_unix_nano >= tokenize.end_time_unix_nano
    assert answered.start_time_unix_nano >= batches[-1].end_time_unix_nano
    # Each pass's size and tokens: the request's inputs and tokens, over its passes.
    passes = [attributes(s) for s in batches]
    assert sum(p["batchfit.batch.size"] for p in passes) == len(TEXTS)
    tokens = answer.json()["usage"]["prompt_tokens"]
    assert sum(p["batchfit.batch.tokens"] for p in passes) == tokens
    for tags in passes:
        assert tags["batchfit.batch.padded_tokens"] >= tags["batchfit.batch.tokens"] > 0
        assert tags["batchfit.batch.number"] >= 1
    # The header and the spans tell the same time in the model.
    in_batches_ms = sum(s.end_time_unix_nano - s.start_time_unix_nano for s in batches) / 1e6
    assert float(answer.headers["x-batchfit-inference-time"]) == pytest.approx(
        in_batches_ms, abs=0.01
    )


def test_a_request_without_traceparent_starts_a_trace(traced):
    answer = httpx.post(f"{traced.url}/v1/infer", json={"inputs": TEXTS[:2]}, timeout=60)
    assert answer.status_code == 200, answer.text
    request_id = answer.headers["x-request-id"]

    def arrived(spans: list[Span]) -> bool:
        return any(attributes(s).get("batchfit.request_id") == request_id for s in spans)

    spans = traced.receiver.wait_for(arrived)
    (request,) = [s for s in spans if attributes(s).get("batchfit.request_id") == request_id]
    assert request.name == "POST /v1/infer"
    assert request.parent_span_id == b""
    assert len(request.trace_id) == 16 and any(request.trace_id)


def test_a_refused_request_is_traced_with_its_error(traced):
    trace_id, parent_id = ids()
    answer = httpx.post(
        f"{traced.url}/v1/infer", json={"inputs": []},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}, timeout=60,
    )  # fmt: skip
    assert answer.status_code == 400
    assert not any(header in answer.headers for header in TIMING_HEADERS)

    def arrived(spans: list[Span]) -> bool:
        return any(s.trace_id.hex() == trace_id and s.name == "POST /v1/infer" for s in spans)

    spans = traced.receiver.wait_for(arrived)
    (request,) = [s for s in spans if s.trace_id.hex() == trace_id and s.name == "POST /v1/infer"]
    assert request.parent_span_id.hex() == parent_id
    # Refused before the runtime: nothing ran for it but its answer.
    others = {s.name for s in spans if s.trace_id.hex() == trace_id and s is not request}
    assert others <= {"answer"}
    assert attributes(request)["error.type"] == "empty_input"
    assert attributes(request)["http.response.status_code"] == 400


def test_the_last_spans_are_sent_as_the_replica_stops(tmp_path):
    """Spans held for a minute by the exporter's schedule still leave on SIGTERM."""
    trace_id, parent_id = ids()
    with otlp_receiver() as receiver:
        with run_server(
            tmp_path, "--otlp-endpoint", receiver.url, env={"OTEL_BSP_SCHEDULE_DELAY": "60000"}
        ) as server:
            answer = httpx.post(
                f"{server.url}/v1/infer", json={"inputs": TEXTS},
                headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}, timeout=60,
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
            assert not receiver.spans  # held by the schedule
        spans = [s for s in receiver.spans if s.trace_id.hex() == trace_id]
    assert {s.name for s in spans} >= {"POST /v1/infer", *CHILDREN}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/infer", {"inputs": TEXTS}),
        ("/v1/embeddings", {"input": TEXTS, "model": "{model}"}),
        ("/v2/models/{model}/infer", {"inputs": [
            {"name": "text", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}
        ]}),
    ],
)  # fmt: skip
def test_timing_headers_without_tracing(plain, path, body):
    model = model_of(plain.url)
    if body.get("model"):
        body = {**body, "model": model}
    started = time.perf_counter()
    answer = httpx.post(f"{plain.url}{path.format(model=model)}", json=body, timeout=60)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    assert answer.status_code == 200, answer.text
    times = {header: float(answer.headers[header]) for header in TIMING_HEADERS}
    assert all(value >= 0 for value in times.values()), times
    assert times["x-batchfit-inference-time"] > 0, times
    assert sum(times.values()) < elapsed_ms, (times, elapsed_ms)
