"""The real replica as a person meets it: start-up lines, the access log, the live status page
and the API docs in a real headless Chromium, under real traffic, behind an API key."""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from server.status.history import GENERATION_FIELDS
from tests.browser import Page, open_page, overlapping, require_chromium
from tests.generators import tiny_generator
from tests.servers import run_server

pytestmark = pytest.mark.integration

KEY = "K123-status"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET = "a private sentence that must never reach a log"
TEXTS = [SECRET, "short", "a somewhat longer input with more tokens in it to pad", "two words"]
MiB = 2**20
# Where the page's summary numbers sit, and how the page rounds them.
UNIT_SCALE = {"rate": 1, "ms": 1, "mean": 1, "count": 1, "bytes": 1 / MiB, "percent": 100}
CHART_SERIES_COLOR = (0x1F, 0x77, 0xB4)  # the first series of the requests and memory charts
CHARTS = ["requests", "queue", "batches", "memory"]
GENERATION_CHARTS = [
    "generationTokens", "generationLatency", "generationSequences", "generationCache",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_chromium()  # before the model loads: fail (CI) or skip at once
    with run_server(
        tmp_path_factory.mktemp("status"), "--api-key", KEY, "--access-log",
        "--status-window-s", "60", "--cache-bytes", "64MiB",
    ) as server:  # fmt: skip
        yield server


class Traffic:
    """A few clients sending inference requests until stopped (bounded in count and time)."""

    def __init__(self, url: str, clients: int = 3, max_requests: int = 3000) -> None:
        self.url, self.max_requests = url, max_requests
        self.stop = threading.Event()
        self.sent = 0
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, offset: int) -> None:
        with httpx.Client(timeout=30, headers=AUTH) as client:
            i = offset
            while not self.stop.is_set() and self.sent < self.max_requests:
                self.sent += 1
                # Repeated texts (cache hits after the first) and one new input, so that
                # batches keep running too.
                inputs = [*TEXTS[: 1 + i % len(TEXTS)], f"client {offset} request {i}"]
                self.statuses.append(
                    client.post(f"{self.url}/v1/infer", json={"inputs": inputs}).status_code
                )
                i += 1

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def test_start_up_says_what_it_is_doing_then_one_ready_line(server):
    log = server.log()
    listening = log.index(f"listening on http://127.0.0.1:{server.port}; loading the model")
    ready = re.search(r"ready in [\d.]+s: (.*)", log)
    assert ready is not None, log
    assert listening < log.index("warming up") < ready.start()
    assert "Uvicorn running" not in log
    line = ready.group(1)
    assert line.startswith(
        f"http://127.0.0.1:{server.port} serves all-MiniLM-L6-v2 (embed: mean pooling, "
        "normalised, 384 dims) on cpu, float32; "
        "memory budget "
    ), line
    assert re.search(r"memory budget [\d,]+ MiB per batch \(.*at most \d+ items", line), line


def _same_origin(url: str, port: int) -> bool:
    parts = urlsplit(url)
    return (parts.scheme, parts.hostname, parts.port) == ("http", "127.0.0.1", port)


def _chart_pixels(page, name: str) -> int:
    """Canvas pixels of the chart's first series colour: the line is really drawn."""
    r, g, b = CHART_SERIES_COLOR
    return page.evaluate(
        f"""(() => {{
          const c = window.batchfitStatus.charts[{json.dumps(name)}].ctx.canvas;
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < d.length; i += 4)
            if (Math.abs(d[i]-{r}) < 24 && Math.abs(d[i+1]-{g}) < 24 && Math.abs(d[i+2]-{b}) < 24
                && d[i+3] > 200) n++;
          return n;
        }})()"""
    )


def test_status_page_draws_live_data_that_matches_status_json(server, tmp_path):
    # BATCHFIT_STATUS_SCREENSHOT=docs/status-page.png keeps the screenshot, after longer traffic.
    keep = os.environ.get("BATCHFIT_STATUS_SCREENSHOT")
    min_samples = 40 if keep else 3
    with (
        Traffic(server.url, max_requests=30000 if keep else 3000) as traffic,
        open_page(tmp_path) as page,
    ):
        # The page asks for the key (HTTP Basic); a person types it at the browser's prompt.
        page.answer_auth_prompts("me", KEY)
        page.record_canvas_text()
        page.navigate(f"{server.url}/status")
        page.wait_for(
            "window.batchfitStatus && window.batchfitStatus.samples.filter("
            "s => s.requests_per_s > 0 && s.batch_size !== null && s.latency_p99_ms !== null"
            f").length >= {min_samples} && document.getElementById('summary').dataset.t !== ''",
            timeout_s=20 + min_samples,
        )
        dom = page.evaluate(
            """(() => {
              const s = document.getElementById('summary');
              return {t: s.dataset.t, model: document.getElementById('model-name').textContent,
                      state: document.getElementById('state').textContent,
                      values: [...s.querySelectorAll('.value')].map(e => ({id: e.id,
                        value: e.dataset.value, text: e.textContent, unit: e.dataset.unit}))};
            })()"""
        )
        pixels = {name: _chart_pixels(page, name) for name in ("requests", "memory")}
        generation = page.evaluate(
            "({hidden: document.getElementById('generation').hidden,"
            " charts: Object.keys(window.batchfitStatus.charts)})"
        )
        texts = page.evaluate(
            "Object.fromEntries(Object.entries(window.batchfitStatus.charts).map(([k, c]) => [k, "
            "{boxes: window.canvasTextBoxes(c.ctx.canvas), plotRight: c.bbox.left + c.bbox.width,"
            " plotLeft: c.bbox.left}]))"
        )
        drawn = page.evaluate(
            "Object.fromEntries(Object.entries(window.batchfitStatus.charts).map("
            "([k, c]) => [k, c.data[0].length]))"
        )
        status = httpx.get(f"{server.url}/status.json", headers=AUTH, timeout=10).json()
        screenshot = tmp_path / "status-page.png"
        page.screenshot(screenshot)
        errors, urls = page.errors(), page.requested_urls()
    assert traffic.sent > 0 and set(traffic.statuses) == {200}, set(traffic.statuses)
    assert errors == []
    assert urls and all(_same_origin(u, server.port) for u in urls), urls
    assert dom["model"] == "all-MiniLM-L6-v2" and dom["state"] == "ready"
    # No generator here: no generation section, and no empty charts for it.
    assert generation == {"hidden": True, "charts": CHARTS}
    assert status["generators"] == [] and sample_generation_is_null(status)
    assert all(length >= 3 for length in drawn.values()), drawn
    assert all(count > 30 for count in pixels.values()), pixels
    # No axis label overlaps a tick number (nor any text another), on every chart; the memory
    # chart's right axis, whose free-memory numbers are the widest, in particular.
    for name, chart in texts.items():
        assert overlapping(chart["boxes"]) == [], (name, chart["boxes"])
    memory = texts["memory"]
    (label,) = [box for box in memory["boxes"] if box["text"] == "free MiB"]
    right_ticks = [box for box in memory["boxes"]
                   if box is not label and box["left"] >= memory["plotRight"]]  # fmt: skip
    assert len(right_ticks) >= 2, memory["boxes"]
    assert all(tick["right"] < label["left"] for tick in right_ticks), (label, right_ticks)
    # The numbers shown are those of the sample the page names, still in the ring buffer.
    [sample] = [s for s in status["samples"] if s["t"] == float(dom["t"])]
    for tile in dom["values"]:
        expected = sample[tile["id"]]
        if expected is None:
            assert (tile["value"], tile["text"]) == ("", "\u2013"), tile
            continue
        assert float(tile["value"]) == expected, tile
        shown = float(re.sub(r"[^\d.\-]", "", tile["text"]))
        assert abs(shown - expected * UNIT_SCALE[tile["unit"]]) <= 0.5, tile
    assert sample["memory_free_bytes"] and sample["budget_bytes"] and sample["predicted_peak_bytes"]
    # The traffic repeats its four texts: after the first, every input is a cache hit.
    assert 0.5 < sample["cache_hit_rate"] < 1 and sample["cache_bytes"] > 0
    assert screenshot.stat().st_size > 20_000
    if keep:
        Path(keep).write_bytes(screenshot.read_bytes())


def sample_generation_is_null(status: dict) -> bool:
    return all(s["generated_tokens_per_s"] is None for s in status["samples"])


STATIC = Path(__file__).resolve().parents[2] / "server" / "status" / "static"


@contextmanager
def static_status_page(
    samples: list[dict[str, object]], generators: list[str] | None = None
) -> Iterator[str]:
    """The status page's own files, and a /status.json that always answers ``samples`` (and
    ``generators``: the page's generation section): the page alone, without a replica."""
    answer = json.dumps({"window_s": 300, "samples": samples, "ready": True,
                         "draining": False, "model": None,
                         "generators": generators or []}).encode()  # fmt: skip

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/status":
                body, kind = (STATIC / "status.html").read_bytes(), "text/html"
            elif path.startswith("/status/assets/") and (STATIC / Path(path).name).is_file():
                file = STATIC / Path(path).name
                body = file.read_bytes()
                kind = "text/css" if file.suffix == ".css" else "text/javascript"
            elif path == "/status.json":
                body, kind = answer, "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextmanager
def static_page_open(
    tmp_path: Path, samples: list[dict[str, object]], generators: list[str] | None = None
) -> Iterator[Page]:
    """``static_status_page`` open in the browser, its charts' texts recorded, once it has
    read ``samples``."""
    with static_status_page(samples, generators) as url, open_page(tmp_path) as page:
        page.record_canvas_text()
        page.navigate(f"{url}/status")
        page.wait_for(
            f"window.batchfitStatus && window.batchfitStatus.samples.length === {len(samples)}"
        )
        yield page


@pytest.mark.parametrize("generators", [[], ["gen"]], ids=["encoders", "generator"])
def test_no_axis_number_overlaps_its_label_when_data_returns_after_a_gap(tmp_path, generators):
    # A window without batches hides the batch chart's y axes; when batches return, the plot's
    # height changes while uPlot sizes the axes. Every chart, from no data to a range whose
    # tick numbers differ in width with the plot's height (0.2 against 0.25 steps); the
    # generation charts too, on a replica that serves a generator.
    require_chromium()
    now = time.time()
    samples = [{"t": now - 10 + i, "requests_per_s": None, "batch_size": None,
                "padded_tokens": None, "queue_depth": None, "latency_p50_ms": None,
                "latency_p99_ms": None, "memory_free_bytes": None, "budget_bytes": None,
                "predicted_peak_bytes": None, "measured_peak_bytes": None,
                **dict.fromkeys(GENERATION_FIELDS)}
               for i in range(10)]  # fmt: skip
    charts = CHARTS + (GENERATION_CHARTS if generators else [])
    with static_page_open(tmp_path, samples, generators) as page:
        drawn = page.evaluate(
            """(async () => {
              const painted = () => new Promise((done) => setTimeout(done, 0));
              const found = [];
              for (const [name, chart] of Object.entries(window.batchfitStatus.charts)) {
                const xs = chart.data[0];
                const empty = chart.batchfitSeries.map(() => xs.map(() => null));
                for (let step = 0; step < 30; step++) {
                  const low = 0.5 + step / 10;
                  chart.setData([xs, ...empty]);
                  await painted();
                  chart.setData([xs, ...chart.batchfitSeries.map((_, j) =>
                    xs.map((_, i) => (j + 1) * (low + 0.85 * i / (xs.length - 1))))]);
                  await painted();
                  // The page's own poll may have drawn its samples since: such a case is
                  // left out, not failed.
                  const ours = chart.data[1][0] !== null;
                  found.push({name, low, ours, boxes: window.canvasTextBoxes(chart.ctx.canvas)});
                }
              }
              return found;
            })()"""
        )
        errors = page.errors()
    assert errors == []
    assert sorted({d["name"] for d in drawn}) == sorted(charts)
    ours = [d for d in drawn if d["ours"]]
    assert len(drawn) == len(charts) * 30 and len(ours) >= 25 * len(charts), len(ours)
    # Time labels, axis labels and tick numbers; a generation chart has one y axis, and its
    # 10-s window may show one time label.
    assert all(len(d["boxes"]) > (5 if d["name"] in CHARTS else 3) for d in ours), ours[:1]
    clashes = [(d["name"], d["low"], overlapping(d["boxes"])) for d in ours]
    assert [clash for clash in clashes if clash[2]] == []


def test_api_docs_render_offline_in_the_browser(server, tmp_path):
    with open_page(tmp_path) as page:
        page.answer_auth_prompts("me", KEY)
        page.navigate(f"{server.url}/docs")
        title = page.wait_for(
            "(document.querySelector('.swagger-ui .info .title') || {}).textContent"
        )
        operations = page.evaluate("document.querySelectorAll('.opblock').length")
        errors, urls = page.errors(), page.requested_urls()
    assert title.startswith("Batchfit")
    assert operations >= 5
    assert errors == []
    assert urls and all(_same_origin(u, server.port) for u in urls), urls


def batch_counts(server) -> tuple[float, float]:
    """Batches run and the items they held so far, from the batcher's own histogram."""
    scrape = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    found = [
        float(re.search(rf"^batchfit_batch_size_{part}\{{.*?\}} (\S+)$", scrape, re.M).group(1))
        for part in ("count", "sum")
    ]
    return found[0], found[1]


def test_access_log_has_one_json_line_per_request_and_no_text(server):
    with httpx.Client(timeout=30, headers=AUTH) as client:
        before = batch_counts(server)  # the replica is idle: only this request runs now
        texts = [f"{text} (once)" for text in TEXTS]  # never sent before: no cache hit
        response = client.post(
            f"{server.url}/v1/infer", json={"inputs": texts}, headers={"X-Request-ID": "acc-1"}
        )
        after = batch_counts(server)
    assert response.status_code == 200
    log = server.log()
    assert SECRET not in log
    entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert not any(e["endpoint"] in ("/status.json", "/health/ready") for e in entries)
    [entry] = [e for e in entries if e["request_id"] == "acc-1"]
    assert entry["endpoint"] == "/v1/infer" and entry["status"] == 200
    assert (
        entry["inputs"] == len(TEXTS)
        and entry["tokens"] == response.json()["usage"]["input_tokens"]
    )
    # Each batch that answered it, as the batcher counted them: alone, its inputs only.
    assert len(entry["batch_sizes"]) == after[0] - before[0] >= 1
    assert sum(entry["batch_sizes"]) == after[1] - before[1] == len(TEXTS)
    assert 0 <= entry["queue_wait_s"] <= entry["duration_s"]
    assert entry["cache_hits"] == 0


def test_no_time_label_overlaps_another_across_a_new_minute_day_or_year(tmp_path):
    # The x axis's labels, over windows from 10 s to three days, each placed so that a new year
    # (and so a new day, hour and minute) begins just after the window's first tick or further
    # in. Wall-clock time decides where such a change falls in a live window, so every case is
    # drawn here rather than left to the time of the run.
    require_chromium()
    samples = [{"t": time.time() - 10 + i, "requests_per_s": 1.0} for i in range(10)]
    with static_page_open(tmp_path, samples) as page:
        drawn = page.evaluate(
            """(async () => {
              const painted = () => new Promise((done) => setTimeout(done, 0));
              const newYear = new Date(new Date().getFullYear() + 1, 0, 1).getTime() / 1000;
              const found = [];
              for (const span of [10, 60, 300, 3600, 6 * 3600, 3 * 86400])
                for (const before of [0.01, 0.04, 0.1, 0.3, 0.6]) {
                  const start = newYear - before * span;
                  const xs = Array.from({length: 30}, (_, i) => start + span * i / 29);
                  for (const [name, chart] of Object.entries(window.batchfitStatus.charts)) {
                    chart.setData([xs, ...chart.batchfitSeries.map((_, j) =>
                      xs.map((_, i) => (j + 1) * (1 + i)))]);
                    await painted();
                    // The page's own poll may have drawn its samples since: left out, not failed.
                    const ours = chart.data[0][0] === start;
                    const top = chart.bbox.top + chart.bbox.height;  // the x axis is below this
                    const boxes = window.canvasTextBoxes(chart.ctx.canvas);
                    found.push({name, span, before, ours, boxes,
                                labels: boxes.filter((b) => b.top >= top).map((b) => b.text)});
                  }
                }
              return found;
            })()"""
        )
        errors = page.errors()
    assert errors == []
    ours = [d for d in drawn if d["ours"]]
    assert len(drawn) == 6 * 5 * 4 and len(ours) >= 100, len(ours)
    assert all(len(d["labels"]) >= 2 for d in ours), [(d["span"], d["labels"]) for d in ours]
    clashes = [(d["name"], d["span"], d["before"], overlapping(d["boxes"])) for d in ours]
    assert [clash for clash in clashes if clash[3]] == [], str([c for c in clashes if c[3]])


@pytest.fixture(scope="module")
def generator_server(tmp_path_factory):
    require_chromium()
    root = tmp_path_factory.mktemp("status-generator")
    with run_server(
        root, "--model", str(tiny_generator(root, "llama")), "--status-window-s", "60"
    ) as server:
        yield server


class Streams(Traffic):
    """A few clients streaming completions until stopped (bounded in count and time)."""

    def _run(self, offset: int) -> None:
        body = {"model": "llama", "prompt": f"Client {offset} says", "max_tokens": 64,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set() and self.sent < self.max_requests:
                self.sent += 1
                with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                    response.read()
                    self.statuses.append(response.status_code)


def test_status_page_draws_generation_for_a_replica_that_generates(generator_server, tmp_path):
    with Streams(generator_server.url, clients=2) as traffic, open_page(tmp_path) as page:
        page.record_canvas_text()
        page.navigate(f"{generator_server.url}/status")
        page.wait_for(
            "window.batchfitStatus && window.batchfitStatus.samples.filter("
            "s => s.generated_tokens_per_s > 0 && s.ttft_p99_ms !== null"
            " && s.tbt_p99_ms !== null).length >= 3"
            " && document.getElementById('summary').dataset.t !== ''",
            timeout_s=40,
        )
        dom = page.evaluate(
            """(() => ({t: document.getElementById('summary').dataset.t,
              hidden: document.getElementById('generation').hidden,
              window: document.getElementById('generation-window').textContent,
              charts: Object.keys(window.batchfitStatus.charts),
              values: [...document.querySelectorAll('#generation-summary .value')].map(e => ({
                id: e.id, value: e.dataset.value, text: e.textContent, unit: e.dataset.unit}))
            }))()"""
        )
        pixels = {name: _chart_pixels(page, name) for name in GENERATION_CHARTS[:2]}
        boxes = page.evaluate(
            "Object.fromEntries(Object.entries(window.batchfitStatus.charts).map(([k, c]) => "
            "[k, window.canvasTextBoxes(c.ctx.canvas)]))"
        )
        status = httpx.get(f"{generator_server.url}/status.json", timeout=10).json()
        errors = page.errors()
    assert traffic.sent > 0 and set(traffic.statuses) == {200}, set(traffic.statuses)
    assert errors == []
    assert status["generators"] == ["llama"]
    assert dom["hidden"] is False and dom["window"] == "60"
    assert dom["charts"] == CHARTS + GENERATION_CHARTS
    assert all(count > 30 for count in pixels.values()), pixels
    for name, chart_boxes in boxes.items():
        assert overlapping(chart_boxes) == [], (name, chart_boxes)
    # The tiles show the sample the page names, every generation figure of it.
    [sample] = [s for s in status["samples"] if s["t"] == float(dom["t"])]
    assert [tile["id"] for tile in dom["values"]] == list(GENERATION_FIELDS)
    for tile in dom["values"]:
        expected = sample[tile["id"]]
        if expected is None:
            assert (tile["value"], tile["text"]) == ("", "\u2013"), tile
            continue
        assert float(tile["value"]) == expected, tile
        shown = float(re.sub(r"[^\d.\-]", "", tile["text"]))
        assert abs(shown - expected * UNIT_SCALE[tile["unit"]]) <= 0.5, tile
    assert 0 < sample["tbt_p50_ms"] <= sample["tbt_p99_ms"]
    assert 0 < sample["ttft_p50_ms"] <= sample["ttft_p99_ms"]
    assert sample["kv_cache_budget_bytes"] > 0
    # Generation requests count in the page's requests and latency too.
    assert any(s["requests_per_s"] > 0 and s["latency_p99_ms"] for s in status["samples"])
