"""The status page's ring buffer and its JSON, over fake time and a scripted model."""

import base64
import time

import pytest
from prometheus_client import CollectorRegistry

from batching import BatchingMetrics, MemoryMetrics
from generation import GenerationMetrics
from server import Settings, create_app
from server.middleware import COUNTED_ENDPOINTS, RequestRecord, _v2_endpoint
from server.status import SAMPLE_FIELDS, StatusHistory, percentile
from server.status.history import GENERATION_FIELDS, histogram_percentile
from tests.fakes import ScriptedModel
from tests.test_app import assert_error, running


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 0.5, None),
        ([7.0], 0.99, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
        ([float(i) for i in range(1, 101)], 0.99, 99.0),
        ([float(i) for i in range(1, 101)], 0.5, 50.0),
        ([float(i) for i in range(1, 11)], 0.99, 10.0),
        ([float(i) for i in range(1, 11)], 0.91, 10.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0.5, 3.0),
    ],
)
def test_percentile_is_nearest_rank(values, q, expected):
    assert percentile(values, q) == expected


def _record(endpoint="/v1/infer", status=200, duration_s=0.01):
    return RequestRecord(
        request_id="r", method="POST", path=endpoint, endpoint=endpoint, status=status,
        error_type="", duration_s=duration_s, trace=None,
    )  # fmt: skip


def test_another_process_takes_its_requests_and_the_history_adds_them(registry):
    """With API processes: each one's ``take`` empties its tally into the engine's ``add``."""
    api_process = StatusHistory(registry, queue_depth=lambda: 0, window_s=10)
    engine = StatusHistory(registry, queue_depth=lambda: 0, window_s=10)
    engine.sample(wall_s=100.0, mono_s=50.0)
    for ms in (10, 30):
        api_process.observe(_record(duration_s=ms / 1000))
    api_process.observe(_record(status=500))
    engine.observe(_record(duration_s=0.02))  # the engine's own would count too
    engine.add(*api_process.take())
    assert api_process.take() == (0, 0, [])  # taken once
    sample = engine.sample(wall_s=101.0, mono_s=51.0)
    assert sample["requests_per_s"] == 4 and sample["errors_per_s"] == 1
    assert (sample["latency_p50_ms"], sample["latency_p99_ms"]) == (20.0, 30.0)


def test_a_sample_sums_up_its_interval(registry):
    batching = BatchingMetrics(registry, max_batch_size=32, max_batch_tokens=4096)
    memory = MemoryMetrics(registry)
    depth = [0]
    history = StatusHistory(registry, queue_depth=lambda: depth[0], window_s=10)
    memory.free_bytes.set(1000)
    assert history.sample(wall_s=100.0, mono_s=50.0)["memory_free_bytes"] is None  # no batch yet
    for ms in range(1, 101):  # 100 successes of 1..100 ms in 2 seconds
        history.observe(_record(duration_s=ms / 1000))
    history.observe(_record(status=429, duration_s=5.0))
    history.observe(_record(endpoint="other", duration_s=9.0))  # not an inference request
    for size, tokens in ((4, 64), (8, 256)):
        batching.batch_size.labels("a").observe(size)
        batching.batch_tokens.labels("a").observe(tokens)
    memory.oom_events.labels("a", "split").inc(3)
    memory.oom_events.labels("a", "failed").inc()
    memory.free_bytes.set(1000)
    memory.budget_bytes.labels("a").set(800)
    memory.measured_peak.labels("a").set(300)
    depth[0] = 5
    sample = history.sample(wall_s=102.0, mono_s=52.0)
    assert tuple(sample) == SAMPLE_FIELDS
    assert sample == {
        "t": 102.0, "requests_per_s": 50.5, "errors_per_s": 0.5, "latency_p50_ms": 50.0,
        "latency_p99_ms": 99.0, "queue_depth": 5, "batches": 2, "batch_size": 6.0,
        "padded_tokens": 160.0, "memory_free_bytes": 1000, "budget_bytes": 800,
        "predicted_peak_bytes": 0, "measured_peak_bytes": 300, "oom_splits_total": 3,
        "cache_hit_rate": None, "cache_bytes": 0,
        # No generator: no generation figures at all (not zeros).
        **dict.fromkeys(GENERATION_FIELDS),
    }  # fmt: skip
    quiet = history.sample(wall_s=103.0, mono_s=53.0)
    assert quiet["requests_per_s"] == 0 and quiet["latency_p50_ms"] is None
    assert quiet["batches"] == 0 and quiet["batch_size"] is None
    assert quiet["oom_splits_total"] == 3


def test_with_several_models_counters_add_up_and_gauges_read_the_largest(registry):
    batching = BatchingMetrics(registry, max_batch_size=32, max_batch_tokens=4096)
    memory = MemoryMetrics(registry)
    history = StatusHistory(registry, queue_depth=lambda: 0, window_s=10)
    history.sample(wall_s=100.0, mono_s=50.0)
    for model, size, peak in (("a", 4, 300), ("b", 2, 700)):
        batching.batch_size.labels(model).observe(size)
        batching.batch_tokens.labels(model).observe(size * 10)
        memory.oom_events.labels(model, "split").inc()
        memory.measured_peak.labels(model).set(peak)
    sample = history.sample(wall_s=101.0, mono_s=51.0)
    assert (sample["batches"], sample["batch_size"], sample["padded_tokens"]) == (2, 3.0, 30.0)
    assert (sample["oom_splits_total"], sample["measured_peak_bytes"]) == (2, 700)


INF = float("inf")


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        ({}, 0.5, None),
        ({0.1: 0, 1.0: 0, INF: 0}, 0.5, None),
        # 10 observations, all in (0.1, 1]: interpolated inside that bucket.
        ({0.1: 0, 1.0: 10, INF: 10}, 0.5, 0.55),
        ({0.1: 0, 1.0: 10, INF: 10}, 0.99, 0.991),
        # The first bucket starts at 0.
        ({0.1: 4, 1.0: 4, INF: 4}, 0.5, 0.05),
        # 5 below 0.1, 5 in (0.1, 1]: the median is the first bucket's bound.
        ({0.1: 5, 1.0: 10, INF: 10}, 0.5, 0.1),
        ({0.1: 5, 1.0: 10, INF: 10}, 0.6, 0.28),
        # Beyond the last finite bound: that bound, as Prometheus answers.
        ({0.1: 1, 1.0: 2, INF: 10}, 0.99, 1.0),
        # An empty bucket between two: skipped.
        ({0.1: 5, 0.5: 5, 1.0: 10, INF: 10}, 0.75, 0.75),
        # The lowest: where the first observation's bucket starts (no division by its zero).
        ({0.1: 0, 1.0: 10, INF: 10}, 0.0, 0.1),
    ],
)
def test_histogram_percentile_interpolates_as_prometheus_does(buckets, q, expected):
    found = histogram_percentile(buckets, q)
    assert found == (None if expected is None else pytest.approx(expected))


def test_generation_figures_add_up_the_generators_and_read_latency_over_the_window(registry):
    metrics = GenerationMetrics(registry, max_step_tokens=64, max_latency_s=60)
    a, b = metrics.for_model("a"), metrics.for_model("b")
    history = StatusHistory(registry, queue_depth=lambda: 0, window_s=3)  # 3 samples
    first = history.sample(wall_s=100.0, mono_s=50.0)
    assert first["generated_tokens_per_s"] == 0 and first["ttft_p50_ms"] is None
    assert first["running_sequences"] == 0
    for series, tokens in ((a, 30), (b, 10)):
        series.generated_tokens.inc(tokens)
        series.prompt_tokens.inc(tokens * 2)
    for _ in range(10):
        a.time_to_first_token.observe(0.3)  # in (0.25, 0.5]
        b.time_between_tokens.observe(0.015)  # in (0.01, 0.02]
    a.running.set(3)
    b.running.set(2)
    b.waiting.set(4)
    a.cache_bytes.set(1000)
    b.cache_bytes.set(24)
    a.cache_budget_bytes.set(5000)
    b.cache_budget_bytes.set(4000)
    sample = history.sample(wall_s=102.0, mono_s=52.0)  # two seconds later
    assert {key: sample[key] for key in GENERATION_FIELDS} == {
        "generated_tokens_per_s": 20.0, "prompt_tokens_per_s": 40.0,
        "ttft_p50_ms": pytest.approx(375.0), "ttft_p99_ms": pytest.approx(497.5),
        "tbt_p50_ms": pytest.approx(15.0), "tbt_p99_ms": pytest.approx(19.9),
        "running_sequences": 5, "waiting_sequences": 4, "kv_cache_bytes": 1024,
        "kv_cache_budget_bytes": 5000,
    }  # fmt: skip
    # Faster first tokens later on: the window still holds the slow ones, until they leave it.
    for _ in range(30):
        a.time_to_first_token.observe(0.04)  # in (0.025, 0.05]
    later = [history.sample(wall_s=103.0 + i, mono_s=53.0 + i) for i in range(3)]
    assert later[0]["generated_tokens_per_s"] == 0
    assert later[0]["ttft_p50_ms"] == pytest.approx(41.667)  # 20th of 30 in (25, 50] ms
    assert later[0]["ttft_p99_ms"] == pytest.approx(490.0)  # the slow ones: 10 of 40
    assert later[1]["ttft_p99_ms"] == pytest.approx(490.0)
    assert later[2]["ttft_p99_ms"] == pytest.approx(49.75)  # 3 intervals on: only the fast ones
    assert later[2]["tbt_p50_ms"] is None  # no token in the window


def test_the_cache_hit_rate_is_over_every_lookup_since_start(registry):
    from server.cache import CacheMetrics

    cache = CacheMetrics(registry)
    held = {"a": 1000.0, "b": 24.0}
    for model in held:
        cache.add_model(model, lambda m=model: held[m])
    history = StatusHistory(registry, queue_depth=lambda: 0, window_s=10)
    assert history.sample(wall_s=100.0, mono_s=50.0)["cache_hit_rate"] is None  # no lookup
    cache.count("a", hits=5, misses=1, deduplicated=0)
    cache.count("b", hits=1, misses=1, deduplicated=1)
    sample = history.sample(wall_s=101.0, mono_s=51.0)
    assert (sample["cache_hit_rate"], sample["cache_bytes"]) == (0.75, 1024)
    cache.count("a", hits=0, misses=8, deduplicated=0)
    assert history.sample(wall_s=102.0, mono_s=52.0)["cache_hit_rate"] == 0.375


def test_the_ring_buffer_keeps_the_window_and_answers_since(registry):
    history = StatusHistory(registry, queue_depth=lambda: 0, window_s=10)
    for second in range(25):
        history.sample(wall_s=1000.0 + second, mono_s=float(second))
    assert len(history.samples) == 10
    assert [s["t"] for s in history.since(None)] == [1015.0 + i for i in range(10)]
    assert [s["t"] for s in history.since(1022.0)] == [1023.0, 1024.0]
    with pytest.raises(ValueError, match="interval_s"):
        StatusHistory(registry, queue_depth=lambda: 0, window_s=0.5)


async def test_status_json_has_the_model_card_and_new_samples(registry):
    async with running(ScriptedModel(), registry, status_window_s=10) as client:
        assert (await client.post("/v1/infer", json={"inputs": ["a", "b c"]})).status_code == 200
        history = client._transport.app.state.status_history
        history.sample(wall_s=2e9, mono_s=time.monotonic())
        body = (await client.get("/status.json")).json()
        newer = (await client.get("/status.json", params={"since": 2e9})).json()
        page = await client.get("/status")
    assert body["ready"] is True and body["window_s"] == 10
    assert (
        body["model"]["name"] == "scripted"
        and body["model"]["max_batch_size"] == Settings().max_batch_size
    )
    assert body["samples"][-1]["t"] == 2e9
    assert sum(s["requests_per_s"] for s in body["samples"]) > 0
    assert newer["samples"] == []
    assert body["generators"] == []  # the page draws no generation charts
    assert body["samples"][-1]["generated_tokens_per_s"] is None
    assert page.status_code == 200 and "/status/assets/uPlot.iife.min.js" in page.text


async def test_status_page_is_behind_the_api_key_and_a_browser_can_send_it(registry):
    basic = base64.b64encode(b"anyone:K123").decode()
    async with running(ScriptedModel(), registry, api_key="K123") as client:
        for path in ("/status", "/status.json", "/status/assets/status.js"):
            refused = await client.get(path)
            assert_error(refused, 401, "unauthorized")
            assert refused.headers["www-authenticate"].startswith('Basic realm="batchfit"')
            assert (await client.get(path, headers={"Authorization": f"Basic {basic}"})).is_success
            bearer = await client.get(path, headers={"Authorization": "Bearer K123"})
            assert bearer.is_success
        wrong = base64.b64encode(b"anyone:nope").decode()
        assert_error(
            await client.get("/status.json", headers={"Authorization": f"Basic {wrong}"}),
            401, "unauthorized",
        )  # fmt: skip
        # Basic auth is for browser pages only; the API still wants the bearer key.
        infer = await client.post(
            "/v1/infer", json={"inputs": "a"}, headers={"Authorization": f"Basic {basic}"}
        )
        assert_error(infer, 401, "unauthorized")


def inference_routes():
    """Every POST route of a replica but the admin ones, as the request middleware labels it."""
    app = create_app(Settings(), model=ScriptedModel(), registry=CollectorRegistry())
    schema = app.openapi()["paths"]
    paths = {path for path, methods in schema.items()
             if "post" in methods and not path.startswith("/admin")}  # fmt: skip
    return sorted({path if path in COUNTED_ENDPOINTS else _v2_endpoint(path) for path in paths})


@pytest.mark.parametrize("endpoint", inference_routes())
def test_every_inference_endpoint_counts_in_requests_errors_and_latency(registry, endpoint):
    assert endpoint != "other"
    history = StatusHistory(registry, queue_depth=lambda: 0, window_s=10)
    history.sample(wall_s=100.0, mono_s=50.0)
    history.observe(_record(endpoint=endpoint, duration_s=0.02))
    history.observe(_record(endpoint=endpoint, status=500, duration_s=0.5))
    sample = history.sample(wall_s=101.0, mono_s=51.0)
    assert (sample["requests_per_s"], sample["errors_per_s"]) == (2.0, 1.0)
    assert sample["latency_p50_ms"] == sample["latency_p99_ms"] == 20.0


def test_the_inference_routes_include_rerank():
    assert "/v1/rerank" in inference_routes() and len(inference_routes()) >= 4
