"""The metric set: names, buckets, what the batcher records, and the separate metrics port."""

import asyncio
import logging
import re
import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from batching import BatchingMetrics, MemoryMetrics
from batching.metrics import latency_buckets, powers_of_two
from server import Settings, create_app
from server.cli import build_parser, settings_from_args
from server.cli import main as cli_main
from server.metrics import ServerMetrics
from tests.fakes import ScriptedModel
from tests.servers import free_port

TIMEOUT = 10
LOW_CARDINALITY_LABELS = {
    "endpoint", "code", "error_type", "reason", "stage", "outcome", "le", "name", "task",
    "device", "dtype", "model", "probe",
}  # fmt: skip


def full_registry(**settings) -> CollectorRegistry:
    """Every metric, with the model's series as the batcher creates them at start-up."""
    registry = CollectorRegistry()
    runtime = create_app(
        Settings(**settings), model=ScriptedModel(), registry=registry
    ).state.runtime
    runtime.batching_metrics.for_model("scripted")
    runtime.memory_metrics.for_model("scripted")
    return registry


def families(registry: CollectorRegistry) -> dict[str, Metric]:
    return {family.name: family for family in registry.collect()}


def test_every_metric_follows_prometheus_naming():
    found = families(full_registry())
    assert len(found) >= 35
    for name, family in found.items():
        assert name.startswith("batchfit_"), name
        assert family.type != "summary", f"{name}: histograms, not summaries"
        assert family.documentation, f"{name} has no help text"
        samples = [s.name for s in family.samples]
        if family.type == "counter":
            assert all(s.endswith("_total") for s in samples), (name, samples)
        else:
            assert not name.endswith("_total"), name
        if "memory" in name or "peak_bytes" in name or name.endswith("_bytes"):
            assert name.endswith(("_bytes", "_ratio")), f"{name}: memory in bytes"
        if re.search(r"(^|_)(duration|wait|latency)(_|$)", name):
            assert name.endswith("_seconds"), f"{name}: times in seconds"
        labels = {label for sample in family.samples for label in sample.labels}
        assert labels <= LOW_CARDINALITY_LABELS, (name, labels)


def test_the_issue_metric_set_is_exported():
    found = families(full_registry())
    required = {
        # requests, latency, queue and batch times
        "batchfit_requests": "counter", "batchfit_request_duration_seconds": "histogram",
        "batchfit_queue_wait_seconds": "histogram",
        "batchfit_batch_duration_seconds": "histogram",
        # queue, in flight, rejections, cancellations
        "batchfit_queue_depth": "gauge", "batchfit_queue_capacity": "gauge",
        "batchfit_requests_in_flight": "gauge", "batchfit_rejections": "counter",
        "batchfit_cancelled_items": "counter",
        # batching
        "batchfit_batch_size": "histogram", "batchfit_batch_tokens": "histogram",
        "batchfit_batch_padding_ratio": "histogram",
        "batchfit_batch_padded_tokens": "counter", "batchfit_batch_real_tokens": "counter",
        "batchfit_batch_budget_items": "gauge", "batchfit_batch_budget_tokens": "gauge",
        "batchfit_batch_budget_bytes": "gauge",
        # memory
        "batchfit_device_memory_used_bytes": "gauge",
        "batchfit_device_memory_total_bytes": "gauge",
        "batchfit_torch_allocated_bytes": "gauge", "batchfit_torch_reserved_bytes": "gauge",
        "batchfit_host_resident_bytes": "gauge",
        "batchfit_batch_predicted_peak_bytes": "gauge",
        "batchfit_batch_measured_peak_bytes": "gauge",
        "batchfit_memory_headroom_bytes": "gauge", "batchfit_oom_events": "counter",
        # state
        "batchfit_ready": "gauge", "batchfit_draining": "gauge", "batchfit_model": "info",
        "batchfit_model_threads": "gauge",
    }  # fmt: skip
    missing = {name for name in required if name not in found}
    assert not missing
    assert {name: found[name].type for name in required} == required


def test_labelled_counters_start_at_zero_for_every_known_value():
    registry = full_registry()
    for reason in ("queue_full", "draining", "not_ready", "too_large", "invalid", "deadline"):
        assert registry.get_sample_value("batchfit_rejections_total", {"reason": reason}) == 0
    for stage in ("queued", "running"):
        assert registry.get_sample_value("batchfit_cancelled_items_total", {"stage": stage}) == 0
    # A model's series exist (at 0) from the moment the batcher takes it on.
    MemoryMetrics(registry := CollectorRegistry()).for_model("m")
    for outcome in ("split", "failed"):
        labels = {"outcome": outcome, "model": "m"}
        assert registry.get_sample_value("batchfit_oom_events_total", labels) == 0


@pytest.mark.parametrize(
    ("max_timeout_s", "max_batch_size", "max_batch_tokens"),
    [(300, 32, 4096), (600, 64, 1000), (20, 1, 1)],
)
def test_buckets_reach_the_configured_maxima(max_timeout_s, max_batch_size, max_batch_tokens):
    registry = full_registry(
        max_timeout_s=max_timeout_s, default_timeout_s=min(60, max_timeout_s),
        max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
    )  # fmt: skip

    def top_bucket(name):
        buckets = [s.labels["le"] for s in families(registry)[name].samples if "le" in s.labels]
        assert buckets[-1] == "+Inf"
        return float(buckets[-2])

    assert top_bucket("batchfit_queue_wait_seconds") == max_timeout_s
    assert top_bucket("batchfit_batch_size") == max_batch_size
    assert top_bucket("batchfit_batch_tokens") == max_batch_tokens


@pytest.mark.parametrize(
    ("max_s", "expected_tail"),
    [(300, (120.0, 300.0)), (10, (5.0, 10.0)), (45, (30.0, 45.0)), (600, (300.0, 600.0))],
)
def test_latency_buckets_end_at_the_longest_deadline(max_s, expected_tail):
    buckets = latency_buckets(max_s)
    assert buckets[-2:] == expected_tail
    assert list(buckets) == sorted(set(buckets))
    assert buckets[0] == 0.001


def test_request_duration_buckets_follow_max_timeout():
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, max_latency_s=600)
    metrics.request_duration.labels("/v1/infer", "m").observe(450)
    labels = {"endpoint": "/v1/infer", "model": "m"}
    assert registry.get_sample_value(
        "batchfit_request_duration_seconds_bucket", {**labels, "le": "300.0"}
    ) == 0  # fmt: skip
    assert registry.get_sample_value(
        "batchfit_request_duration_seconds_bucket", {**labels, "le": "600.0"}
    ) == 1  # fmt: skip


def test_powers_of_two():
    assert powers_of_two(32) == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
    assert powers_of_two(100) == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 100.0)
    assert powers_of_two(1) == (1.0,)


def test_memory_metrics_register_on_their_own_registry():
    one, two = CollectorRegistry(), CollectorRegistry()
    MemoryMetrics(one).device_used.set(5)
    MemoryMetrics(two)
    BatchingMetrics(two, max_batch_size=4, max_batch_tokens=16)
    assert one.get_sample_value("batchfit_device_memory_used_bytes") == 5
    assert two.get_sample_value("batchfit_device_memory_used_bytes") == 0


async def test_padding_ratio_and_tokens_per_batch(harness_factory):
    h = harness_factory()
    # costs 3 and 7: padded 2 x 7 = 14, real 10
    h.submit(["a", "b c d e f"])
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert h.model_sample("batchfit_batch_real_tokens_total") == 10
    assert h.model_sample("batchfit_batch_padded_tokens_total") == 14
    assert h.model_sample("batchfit_batch_padding_ratio_count") == 1
    assert h.model_sample("batchfit_batch_padding_ratio_sum") == pytest.approx(1.4)
    assert h.model_sample("batchfit_batch_padding_ratio_bucket", {"le": "1.25"}) == 0
    assert h.model_sample("batchfit_batch_padding_ratio_bucket", {"le": "1.5"}) == 1


async def test_items_dropped_while_queued_count_as_cancelled_queued(harness_factory):
    h = harness_factory()
    pendings = h.submit(["a", "b", "c"])
    pendings[0].future.cancel()
    pendings[2].future.cancel()
    await asyncio.wait_for(h.batcher.step(), TIMEOUT)
    assert h.model.seen == ["b"]
    assert h.sample("batchfit_cancelled_items_total", {"stage": "queued"}) == 2
    assert h.sample("batchfit_cancelled_items_total", {"stage": "running"}) == 0
    assert h.sample("batchfit_queue_depth") == 0


def test_metrics_port_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("BATCHFIT_METRICS_PORT", "8001")
    assert Settings().metrics_port == 8001
    monkeypatch.setenv("BATCHFIT_METRICS_PORT", "70000")
    with pytest.raises(ValueError, match="metrics_port"):
        Settings()


def test_metrics_port_is_a_flag_and_must_differ_from_port():
    args = build_parser().parse_args(["serve", "--metrics-port", "9101"])
    assert settings_from_args(args).metrics_port == 9101
    assert Settings().metrics_port is None
    with pytest.raises(ValueError, match=r"metrics_port \(9000\) must differ from port"):
        Settings(port=9000, metrics_port=9000)


async def test_metrics_port_serves_the_apps_registry_and_the_main_port_does_not(registry, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    app = create_app(Settings(metrics_port=port), model=ScriptedModel(), registry=registry)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as main,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as side,
    ):
        async with asyncio.timeout(TIMEOUT):
            while (await main.get("/health/ready")).status_code != 200:
                await asyncio.sleep(0.01)
        assert (await main.post("/v1/infer", json={"inputs": ["a", "b"]})).status_code == 200
        scrape = await side.get("/metrics")
        assert scrape.status_code == 200
        assert 'batchfit_requests_total{code="200",endpoint="/v1/infer",error_type=""} 1.0' in (
            scrape.text
        )
        assert "batchfit_ready 1.0" in scrape.text
        elsewhere = await side.get("/v1/infer")
        assert elsewhere.status_code == 404
        assert elsewhere.json()["error_type"] == "not_found"
        public = await main.get("/metrics")
        assert public.status_code == 404
        assert public.json()["error_type"] == "not_found"
    logged = [r.getMessage() for r in caplog.records]
    assert f"metrics on http://127.0.0.1:{port}/metrics" in logged
    # uvicorn's own start and stop lines are the main server's to print, not this one's.
    assert not any(m.startswith(("Started server process", "Shutting down")) for m in logged)
    # The metrics server stops with the app: its port refuses connections at once.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT)


async def test_metrics_port_in_use_fails_start_up(registry):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = create_app(Settings(metrics_port=port), model=ScriptedModel(), registry=registry)
        with pytest.raises(OSError):
            async with app.router.lifespan_context(app):
                pass


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_in_use_ends_serve_in_one_line_before_the_model_loads(flag, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = str(free_port())
        ports = [port, other] if flag == "--port" else [other, port]
        argv = ["serve", "--port", str(ports[0]), "--metrics-port", str(ports[1])]
        # A model that does not exist: were it loaded, serve would fail on it instead.
        code = cli_main([*argv, "--model", "/nonexistent/model"])
    assert code == 2
    err = capsys.readouterr().err
    assert err == (
        f"batchfit: cannot listen on 127.0.0.1:{port} ({flag}): Address already in use; "
        "choose another port, or stop what listens there\n"
    )
