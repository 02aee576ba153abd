"""A real replica, scraped by a real Prometheus; every dashboard expression must return data."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest

from bench.servers import stop_process
from tests.dashboards import all_panel_queries
from tests.fakes import HOLD_LOAD_ENV
from tests.prometheus import SHIPPED_CONFIG, require, run_prometheus
from tests.servers import ROOT, free_port, run_server, when_queue_full

pytestmark = pytest.mark.integration

QUEUE_ITEMS = MAX_INPUTS = 16
SENTENCE = "the quick brown fox jumps over the lazy dog while batching saves compute"
WORDS = SENTENCE.split(" ")
# What one wave of bad requests must produce: (status, error_type) for each.
BAD_REQUESTS = [
    ({"inputs": []}, 400, "empty_input"),
    ({"inputs": "x", "input": "typo"}, 422, "invalid_request"),
    ({"inputs": ["x"] * (MAX_INPUTS + 1)}, 413, "too_many_inputs"),
    ({"inputs": WORDS, "timeout_s": 0.001}, 504, "deadline_exceeded"),
]
SCRAPES_TIMEOUT_S = 90
SHOWN = {
    ("Request latency, fleet (p50 / p95 / p99)", "C"),
    ("Requests per second by status code", "A"),
    ("Rejections by reason", "A"),
    ("Mean batch size", "A"),
    ("Padding ratio (padded / real tokens)", "A"),
    ("Host memory: resident and available", "A"),
    ("Batch peak: predicted vs measured", "A"),
    ("Batch peak: predicted vs measured", "B"),
    ("Batch budget: bytes", "A"),
}


def test_shipped_prometheus_config_is_valid():
    promtool = require("promtool")
    result = subprocess.run(
        [promtool, "check", "config", str(SHIPPED_CONFIG)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    require("prometheus")
    metrics_port = free_port()
    with run_server(
        tmp_path_factory.mktemp("replica"),
        "--metrics-port", str(metrics_port), "--max-queue-items", str(QUEUE_ITEMS),
        # Batches of 4: a full queue's inputs take 4 passes, more than run at once (side by
        # side), so the queue holds work for seconds while the 429 is asked for.
        "--max-inputs-per-request", str(MAX_INPUTS), "--max-batch-size", "4",
    ) as server:  # fmt: skip
        server.metrics_url = f"http://127.0.0.1:{metrics_port}"
        yield server


def test_metrics_live_on_the_metrics_port_only(replica):
    scrape = httpx.get(f"{replica.metrics_url}/metrics", timeout=10)
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    assert "batchfit_ready 1.0" in scrape.text
    other = httpx.get(f"{replica.metrics_url}/v1/models", timeout=10)
    assert other.status_code == 404
    assert other.json()["error_type"] == "not_found"
    public = httpx.get(f"{replica.url}/metrics", timeout=10)
    assert public.status_code == 404
    assert set(public.json()) == {"error", "error_type", "request_id"}


def test_real_scrape_passes_promtool_check_metrics(replica):
    promtool = require("promtool")
    httpx.post(f"{replica.url}/v1/infer", json={"inputs": ["warm", "up"]}, timeout=60)
    scrape = httpx.get(f"{replica.metrics_url}/metrics", timeout=10).text
    result = subprocess.run(
        [promtool, "check", "metrics"], input=scrape, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool prints lint problems (and still exits 0 for some of them): there must be none.
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout


async def drive_traffic(replica) -> dict[int, int]:
    """Mixed-length successes at a concurrency that makes batches, then one of each error,
    and a 429 while the queue holds work."""
    codes: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=replica.url, timeout=60) as client:
        semaphore = asyncio.Semaphore(4)  # at most 12 items: never a 429

        async def send(body):
            async with semaphore:
                response = await client.post("/v1/infer", json=body)
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                return response

        texts = [" ".join(WORDS[: 1 + (i * 5) % len(WORDS)]) for i in range(24)]
        bodies = [{"inputs": texts[i : i + 1 + i % 3]} for i in range(24)]
        responses = await asyncio.gather(*(send(body) for body in bodies))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        for body, status, error_type in BAD_REQUESTS:
            response = await send(body)
            assert (response.status_code, response.json()["error_type"]) == (status, error_type)
    full = await asyncio.to_thread(
        when_queue_full, replica.url, QUEUE_ITEMS,
        lambda: httpx.post(
            f"{replica.url}/v1/infer", json={"inputs": [f"x {i}" for i in range(QUEUE_ITEMS)]}
        ),
        lambda r: r.status_code, metrics_url=f"{replica.metrics_url}/metrics",
    )  # fmt: skip
    assert full.json()["error_type"] == "overloaded"
    codes[429] = 1
    return codes


def wait_for(prometheus, condition, what: str):
    """Poll Prometheus until ``condition()`` returns a true value; return it."""
    deadline = time.monotonic() + SCRAPES_TIMEOUT_S
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"Prometheus never showed {what}:\n{prometheus.log()}")


def value(answer) -> float:
    return float(answer["data"]["result"][0]["value"][1])


def test_every_dashboard_expression_returns_data_from_a_real_prometheus(replica, tmp_path):
    target = replica.metrics_url.removeprefix("http://")
    # The Generation row reads a generator's series, which this replica has not:
    # test_observability_generation.py evaluates it against one that serves a generator.
    queries = [q for q in all_panel_queries() if q.row != "Generation"]
    assert len(queries) > 30
    with run_prometheus(tmp_path, [target], scrape_interval_s=1) as prometheus:
        # Wave one creates every labelled series; wave two, once Prometheus has scraped them,
        # makes their rates non-zero.
        asyncio.run(drive_traffic(replica))
        wait_for(
            prometheus,
            lambda: prometheus.query('batchfit_requests_total{code="504"}')["data"]["result"],
            "the first wave",
        )
        codes = asyncio.run(drive_traffic(replica))
        assert codes[200] == 24 and all(codes[s] == 1 for _, s, _ in BAD_REQUESTS)
        assert codes[429] == 1

        def second_wave_scraped():
            answer = prometheus.query('sum(batchfit_requests_total{code="504"})')
            return answer["data"]["result"] and value(answer) >= 2

        wait_for(prometheus, second_wave_scraped, "the second wave")

        def evaluate_all():
            answers = {q: prometheus.query(q.promql()) for q in queries}
            errors = {str(q): a for q, a in answers.items() if a.get("status") != "success"}
            assert not errors, errors  # a bad expression never gets better: fail at once
            empty = [str(q) for q, a in answers.items() if not a["data"]["result"]]
            return answers if not empty else None

        answers = wait_for(prometheus, evaluate_all, "data for every panel expression")

        # The dashboard's variable: label_values(batchfit_ready, instance).
        instances = httpx.get(
            f"{prometheus.url}/api/v1/label/instance/values",
            params={"match[]": "batchfit_ready"}, timeout=10,
        ).json()["data"]  # fmt: skip
        assert instances == [target]

    by_title = {(q.panel, q.ref): a["data"]["result"] for q, a in answers.items()}
    codes_seen = {r["metric"]["code"] for r in by_title["Requests per second by status code", "A"]}
    assert {"200", "400", "413", "422", "429", "504"} <= codes_seen
    rejections = {
        r["metric"]["reason"]: float(r["value"][1])
        for r in by_title["Rejections by reason", "A"]
    }  # fmt: skip
    for reason in ("queue_full", "too_large", "invalid", "deadline"):
        assert rejections[reason] > 0, rejections
    assert float(by_title["Error ratio", "A"][0]["value"][1]) > 0  # the 504s
    assert float(by_title["Request latency, fleet (p50 / p95 / p99)", "C"][0]["value"][1]) > 0
    assert float(by_title["Mean batch size", "A"][0]["value"][1]) >= 1
    assert float(by_title["Padding ratio (padded / real tokens)", "A"][0]["value"][1]) >= 1
    heat = by_title["Batch size", "A"]
    assert sum(float(r["value"][1]) for r in heat if r["metric"]["le"] == "+Inf") > 0

    resident = by_title["Host memory: resident and available", "A"]
    assert float(resident[0]["value"][1]) > 100 * 2**20  # the model alone is ~90 MB

    # One evaluated query per row, for the record (pytest -s shows it).
    for query, answer in answers.items():
        if (query.panel, query.ref) in SHOWN:
            print(f"\n[{query.row}] {query.panel} [{query.ref}]\n  {query.promql()}")
            for result in answer["data"]["result"][:6]:
                print(f"  {result['metric']} => {result['value'][1]}")


def test_metrics_port_answers_before_the_model_has_loaded(tmp_path):
    """The model's load is held until the test releases it: the metrics port already says
    ``batchfit_ready 0``, and 1 once the replica is ready."""
    release = tmp_path / "release-the-load"
    port, metrics_port = free_port(), free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--metrics-port", str(metrics_port), "--sizer", "fixed",
             "--model", "python:tests.fakes:held_loading_model"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, HOLD_LOAD_ENV: str(release)},
        )  # fmt: skip
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        scrape = poll_scrape(metrics_url, process, lambda text: True, timeout_s=30)
        assert "\nbatchfit_ready 0.0\n" in scrape, scrape
        assert "model loaded" not in log_path.read_text()
        assert httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5).status_code == 503
        release.touch()
        scrape = poll_scrape(metrics_url, process, lambda text: "\nbatchfit_ready 1.0\n" in text)
        assert httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5).status_code == 200
    finally:
        stop_process(process)
    assert "model scripted loaded" in log_path.read_text()


def poll_scrape(url: str, process: subprocess.Popen, done, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the replica exited with {process.returncode}"
        try:
            text = httpx.get(url, timeout=2).text
        except httpx.TransportError:
            text = None
        if text is not None and done(text):
            return text
        time.sleep(0.05)
    raise TimeoutError(f"{url}: no scrape as expected within {timeout_s}s")
