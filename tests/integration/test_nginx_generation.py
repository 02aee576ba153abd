"""Generation through a real Nginx: ``batchfit up`` in front of replicas serving a tiny
random-weight generator (loopback, bounded). A stream's events reach the client as the
tokens are generated, not once the generation ends; a stream is retried on another replica
only before its head, and the generation routes wait for a replica on a read timeout of their
own."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from server.supervise.nginx import GENERATION_ROUTES, exact_paths_regex
from tests.generators import tiny_generator
from tests.launch import (
    CutOffUpstream,
    SilentUpstream,
    StatusUpstream,
    free_port_range,
    run_launcher,
    run_nginx,
)
from tests.loadrun import access_log

pytestmark = pytest.mark.integration

# Nearly the tiny generator's whole context (512 tokens, the prompt's 12 included): about
# 3 ms a token on a CPU, so a stream lasts over a second, long enough to see its events arrive.
MAX_TOKENS = 480
GENERATION_READ_TIMEOUT_S = 900
MODEL = "llama"  # the folder's name, which the replicas serve it as


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    folder = tiny_generator(root, MODEL)
    with run_launcher(
        root, "--model", str(folder), "--replica-ports", str(free_port_range(2 * 2)),
        "--generation-read-timeout-s", str(GENERATION_READ_TIMEOUT_S),
        "--rate-limit-rps", "1000", "--rate-limit-burst", "1000", replicas=2,
    ) as launch:  # fmt: skip
        yield launch


@dataclass
class Stream:
    """What a client read of one streamed answer: each event's data, with the seconds from
    the request's start to its arrival, and how many reads brought them."""

    response: httpx.Response
    events: list[tuple[float, str]]
    reads: int
    error: str = ""

    def chunks(self) -> list[dict]:
        return [json.loads(data) for _, data in self.events if data != "[DONE]"]


def read_stream(url: str, path: str, body: dict, request_id: str) -> Stream:
    events, reads, pending = [], 0, b""
    started = time.monotonic()
    with httpx.stream(
        "POST", url + path, json={**body, "stream": True}, timeout=60,
        headers={"x-request-id": request_id},
    ) as response:  # fmt: skip
        stream = Stream(response, events, 0)
        if response.status_code != 200:
            response.read()  # an answer, not a stream
            return stream
        try:
            for piece in response.iter_bytes():
                arrived_s = time.monotonic() - started
                reads += 1
                *complete, pending = (pending + piece).split(b"\n\n")
                events += [
                    (arrived_s, event.removeprefix(b"data: ").decode()) for event in complete
                ]
        except httpx.RemoteProtocolError as exc:
            stream.error = str(exc)
    stream.reads = reads
    assert pending == b"", pending
    return stream


def completion(model: str, **options: object) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, **options}  # fmt: skip


def assert_streamed_as_generated(stream: Stream) -> None:
    """The events came one by one over the generation's whole length, not in one piece at
    its end (nor in a few large pieces): the first well before the last, some in every
    quarter of the time between them, most in a read of their own."""
    times = [arrived_s for arrived_s, _ in stream.events]
    first_s, last_s = times[0], times[-1]
    span_s = last_s - first_s
    assert span_s > 0.1, f"the events came within {span_s:.3f} s: all at once, or too fast to tell"
    assert first_s < 0.25 * last_s, (first_s, last_s)
    quarters = {min(3, int(4 * (t - first_s) / span_s)) for t in times}
    assert quarters == {0, 1, 2, 3}, times
    assert stream.reads >= len(times) / 4, (stream.reads, len(times))


def test_a_stream_arrives_through_nginx_token_by_token_and_ends_with_done(cluster):
    stream = read_stream(
        cluster.url, "/v1/completions",
        completion(MODEL, stream_options={"include_usage": True}), "stream-1",
    )  # fmt: skip
    assert stream.response.status_code == 200 and stream.error == ""
    first_s, last_s = stream.events[0][0], stream.events[-1][0]
    print(f"\nstream through nginx: {len(stream.events)} events in {stream.reads} reads, "
          f"first after {first_s:.3f} s, last after {last_s:.3f} s")  # fmt: skip
    assert_streamed_as_generated(stream)
    assert stream.response.headers["content-type"].startswith("text/event-stream")
    assert stream.response.headers["x-request-id"] == "stream-1"
    assert "content-encoding" not in stream.response.headers
    assert stream.events[-1][1] == "[DONE]"
    chunks = stream.chunks()
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    entry = access_log(cluster.access_log_path, "stream")["stream-1"]
    assert entry["status"] == 200 and entry["upstream_status"] == "200"  # one replica, one try


def test_a_chat_stream_and_a_whole_completion_pass_through_nginx(cluster):
    chat = read_stream(
        cluster.url, "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
         "max_tokens": 16, "ignore_eos": True},
        "whole-chat",
    )  # fmt: skip
    assert chat.response.status_code == 200 and chat.events[-1][1] == "[DONE]"
    assert chat.chunks()[0]["object"] == "chat.completion.chunk"
    whole = httpx.post(
        f"{cluster.url}/v1/completions", json=completion(MODEL),
        headers={"x-request-id": "whole-completion"}, timeout=60,
    )  # fmt: skip
    assert whole.status_code == 200, whole.text
    assert whole.headers["content-type"] == "application/json"
    body = whole.json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["text"]
    entries = access_log(cluster.access_log_path, "whole", expect=2)
    assert [entries[rid]["upstream_status"] for rid in ("whole-chat", "whole-completion")] == [
        "200", "200",
    ]  # fmt: skip


def test_batchfit_up_renders_the_generation_read_timeout(cluster):
    conf = (cluster.workdir / "nginx.conf").read_text()
    location = conf.split(f"location ~ {exact_paths_regex(GENERATION_ROUTES)} {{", 1)[1]
    block = location.split("\n        }", 1)[0]
    assert f"proxy_read_timeout {GENERATION_READ_TIMEOUT_S}s;" in block
    assert "proxy_buffering off;" in block
    assert "proxy_read_timeout 305s;" in conf  # the other routes': --max-timeout-s + 5


# An operator's Nginx that compresses event streams and ignores X-Accel-Buffering (both in
# the http block, so that every location inherits them): what the generation location's own
# directives must hold out against.
HOSTILE_HTTP = """    gzip on;
    gzip_min_length 1;
    gzip_types text/event-stream application/json;
    proxy_ignore_headers X-Accel-Buffering;
"""


@pytest.fixture
def hostile_nginx(cluster, tmp_path, monkeypatch) -> Iterator[str]:
    from server.supervise import nginx

    template = nginx.TEMPLATE_PATH.read_text().replace(
        "{{http_directives}}\n", "{{http_directives}}\n" + HOSTILE_HTTP
    )
    monkeypatch.setattr("tests.launch.render", lambda config: nginx.render(config, template))
    upstreams = [cluster.address(name) for name in cluster.replicas]
    with run_nginx(tmp_path, upstreams) as front:
        yield front.url


def test_a_stream_is_not_held_back_by_gzip_or_an_ignored_no_buffering_header(
    cluster, hostile_nginx
):
    models = httpx.get(f"{hostile_nginx}/v1/models", timeout=10)
    assert models.headers.get("content-encoding") == "gzip"  # the operator's gzip is on
    stream = read_stream(hostile_nginx, "/v1/completions", completion(MODEL), "hostile")
    assert stream.response.status_code == 200 and stream.events[-1][1] == "[DONE]"
    assert_streamed_as_generated(stream)
    assert "content-encoding" not in stream.response.headers


def test_a_stream_goes_to_another_replica_on_503_before_its_head(cluster, tmp_path):
    body = b'{"error":"draining","error_type":"draining","request_id":"x"}'
    draining = StatusUpstream(503, body, {"content-type": "application/json", "retry-after": "1"})
    try:
        with run_nginx(tmp_path, [draining.address, cluster.address("replica-0")]) as nginx:
            streams = [
                read_stream(nginx.url, "/v1/completions",
                            completion(MODEL, max_tokens=4), f"retry-{n}")
                for n in range(4)
            ]  # fmt: skip
            entries = nginx.access_entries(expect=4)
    finally:
        draining.close()
    assert [s.response.status_code for s in streams] == [200] * 4
    assert all(s.events[-1][1] == "[DONE]" for s in streams)
    retried = [e for e in entries if e["upstream_status"] == "503, 200"]
    assert retried and draining.requests == len(retried), entries


# A replica's stream head and its first event, then nothing: it died mid-stream.
STARTED_STREAM = b"\r\n".join([
    b"HTTP/1.1 200 OK", b"content-type: text/event-stream", b"transfer-encoding: chunked", b"",
    b"%x" % len(b'data: {"choices":[]}\n\n') + b'\r\ndata: {"choices":[]}\n\n', b"",
])  # fmt: skip


def test_a_stream_that_has_started_is_never_retried(cluster, tmp_path):
    dying = CutOffUpstream(STARTED_STREAM)
    try:
        with run_nginx(tmp_path, [dying.address, cluster.address("replica-0")]) as nginx:
            # least_conn breaks the tie between idle replicas in turn: one of the first two
            # requests goes to the dying one.
            streams = {
                f"cut-{n}": read_stream(nginx.url, "/v1/completions",
                                        completion(MODEL, max_tokens=4), f"cut-{n}")
                for n in range(2)
            }  # fmt: skip
            entries = {e["request_id"]: e for e in nginx.access_entries(expect=2)}
    finally:
        dying.close()
    assert dying.requests == 1
    (cut,) = [e for e in entries.values() if e["upstream_addr"].startswith(dying.address)]
    assert cut["upstream_addr"] == dying.address  # no second replica was asked
    cut_stream = streams[cut["request_id"]]
    assert cut_stream.response.status_code == 200
    assert [data for _, data in cut_stream.events] == ['{"choices":[]}']  # no [DONE]
    assert cut_stream.error.startswith("peer closed connection")
    (whole,) = [s for rid, s in streams.items() if rid != cut["request_id"]]
    assert whole.error == "" and whole.events[-1][1] == "[DONE]"


def cancelled_sequences(metrics_url: str) -> float:
    scrape = httpx.get(metrics_url, timeout=10).text
    series = f'batchfit_generation_finished_sequences_total{{model="{MODEL}",reason="cancelled"}}'
    pattern = rf"^{re.escape(series)} (\S+)$"
    return float(re.search(pattern, scrape, re.MULTILINE).group(1))


def test_a_whole_generation_past_the_read_timeout_is_a_504_and_its_sequences_end(cluster, tmp_path):
    """Nginx gives up on a non-streamed generation at its read timeout (here 2 s: 32 sequences
    of 480 tokens take longer) and closes the connection: the replica cancels its sequences."""
    metrics_url = cluster.metrics_urls["replica-0"]
    before = cancelled_sequences(metrics_url)
    body = completion(MODEL, prompt=[f"Prompt {i}" for i in range(4)], n=8)
    with run_nginx(tmp_path, [cluster.address("replica-0")], read_timeout_s=2) as nginx:
        answer = httpx.post(f"{nginx.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 504 and answer.json()["error_type"] == "gateway_timeout"
    deadline = time.monotonic() + 20
    while cancelled_sequences(metrics_url) - before < 32 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled_sequences(metrics_url) - before == 32


def test_the_generation_read_timeout_is_its_own_and_never_retried(tmp_path):
    silent = [SilentUpstream(), SilentUpstream()]
    try:
        with run_nginx(
            tmp_path, [u.address for u in silent], read_timeout_s=2, generation_read_timeout_s=4
        ) as nginx:
            timings = {}
            for path in ("/v1/completions", "/v1/infer"):
                started = time.monotonic()
                answer = httpx.post(f"{nginx.url}{path}", json={}, timeout=30)
                timings[path] = (answer.status_code, time.monotonic() - started)
                assert answer.json()["error_type"] == "gateway_timeout"
            entries = nginx.access_entries(expect=2)
    finally:
        for upstream in silent:
            upstream.close()
    (generation_status, generation_s), (infer_status, infer_s) = timings.values()
    assert generation_status == infer_status == 504
    assert 4 <= generation_s < 6 and 2 <= infer_s < 4, timings
    # One connection each: the retry windows (3 s and 1 s) had ended when the timeouts fired.
    assert sum(len(u.connections) for u in silent) == 2
    assert [e["upstream_status"] for e in entries] == ["504", "504"]
