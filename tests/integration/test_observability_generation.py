"""The dashboard's Generation row against a real Prometheus scraping a real replica that
serves a tiny generator under generation traffic: every expression returns data, and the
figures are those of the traffic sent."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.dashboards import all_panel_queries
from tests.generators import tiny_generator
from tests.prometheus import require, run_prometheus
from tests.servers import free_port, run_server

pytestmark = pytest.mark.integration

MODEL = "llama"
MAX_TOKENS = 48
REQUESTS = 8
SCRAPES_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    require("prometheus")
    root = tmp_path_factory.mktemp("generator")
    metrics_port = free_port()
    with run_server(
        root, "--model", str(tiny_generator(root, MODEL)), "--metrics-port", str(metrics_port)
    ) as server:
        server.metrics_url = f"http://127.0.0.1:{metrics_port}"
        yield server


async def drive_generation(url: str) -> list[int]:
    """Streamed and whole completions and chats at once, every one to its max_tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def send(n: int) -> int:
            chat = n % 2 == 1
            body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "stream": n % 4 < 2}  # fmt: skip
            if chat:
                body["messages"] = [{"role": "user", "content": f"Say something, {n}"}]
            else:
                body["prompt"] = f"Request {n} begins with"
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with client.stream("POST", path, json=body) as response:
                await response.aread()
                return response.status_code

        return await asyncio.gather(*(send(n) for n in range(REQUESTS)))


def assert_shows_the_traffic(answers: dict) -> None:
    """Every panel has data, and the figures are those of finished generation traffic."""
    empty = [str(q) for q, a in answers.items() if not a["data"]["result"]]
    assert not empty, empty
    by_title = {(q.panel, q.ref): a["data"]["result"] for q, a in answers.items()}
    for panel in ("Time to first token (p50 / p99) by model",
                  "Time between tokens (p50 / p99) by model"):  # fmt: skip
        (p50,) = by_title[panel, "A"]
        (p99,) = by_title[panel, "B"]
        assert p50["metric"] == {"model": MODEL}
        assert 0 < float(p50["value"][1]) <= float(p99["value"][1]), (panel, p50, p99)
    for ref in ("A", "B"):  # generated and prompt tokens/s
        (rate,) = by_title["Generated and prompt tokens per second", ref]
        assert rate["metric"] == {"model": MODEL} and float(rate["value"][1]) > 0, rate
    finished = {r["metric"]["reason"]: float(r["value"][1])
                for r in by_title["Finished sequences by reason", "A"]}  # fmt: skip
    assert finished["length"] > 0 and finished["error"] == 0, finished  # ignore_eos: all length
    preempted = {
        r["metric"]["reason"] for r in by_title["Preemptions, resumes and ends for memory", "A"]
    }
    assert preempted == {"memory", "out_of_memory"}
    (budget,) = by_title["Key/value cache: held vs budget", "B"]
    assert float(budget["value"][1]) > 0
    steps = by_title["Step tokens", "A"]
    assert sum(float(r["value"][1]) for r in steps if r["metric"]["le"] == "+Inf") > 0


def test_every_generation_panel_shows_the_generation_traffic(replica, tmp_path):
    queries = [q for q in all_panel_queries() if q.row == "Generation"]
    assert len(queries) >= 15
    target = replica.metrics_url.removeprefix("http://")
    with run_prometheus(tmp_path, [target], scrape_interval_s=1) as prometheus:
        deadline = time.monotonic() + SCRAPES_TIMEOUT_S
        while True:
            # Traffic until Prometheus has scraped enough of it, finished sequences included,
            # for every rate and quantile.
            assert asyncio.run(drive_generation(replica.url)) == [200] * REQUESTS
            time.sleep(2)  # two scrapes after the traffic ended
            answers = {q: prometheus.query(q.promql()) for q in queries}
            errors = {str(q): a for q, a in answers.items() if a.get("status") != "success"}
            assert not errors, errors  # a bad expression never gets better: fail at once
            try:
                assert_shows_the_traffic(answers)
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    print(prometheus.log())
                    raise
