"""Real Nginx in front of real replicas started by ``batchfit up`` (loopback, bounded)."""

from __future__ import annotations

import asyncio
import contextlib
import re

import httpx
import pytest

from models.spec import BUNDLED_MODEL
from models.testing import save_tiny_model
from server import Settings, create_app
from server.public_api import public_api_routes
from tests.launch import (
    CutOffUpstream,
    SilentUpstream,
    StatusUpstream,
    UnreachableUpstream,
    free_port_range,
    run_launcher,
    run_nginx,
)
from tests.loadrun import access_log, load_run, served_by, shares
from tests.servers import free_port, queue_held

pytestmark = pytest.mark.integration

LOAD_REQUESTS = 300
LOAD_CLIENTS = 6
QUEUE_ITEMS = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    # The bundled embedder (the default) and a tiny cross-encoder, so that every API answers.
    reranker = save_tiny_model(root / "rr", task="rerank", seed=3)
    with run_launcher(
        root,
        "--model", BUNDLED_MODEL, "--model", f"rr={reranker}",
        "--replica-ports", str(free_port_range(2 * 3)),
        "--max-batch-size", "8", "--max-queue-items", str(QUEUE_ITEMS),
        "--max-inputs-per-request", str(QUEUE_ITEMS),
        "--rate-limit-rps", "1000", "--rate-limit-burst", "1000",
        replicas=3,
    ) as launch:  # fmt: skip
        yield launch


V2_BODY = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
# A request that succeeds on each public route that needs a body. A route missing here is
# still sent (with an empty JSON object) and must reach a replica.
EXAMPLE_BODIES = {
    ("POST", "/v1/infer"): {"inputs": ["The cat sits on the mat.", "A second sentence"]},
    # The rerank example of docs/api.md.
    ("POST", "/v1/rerank"): {"query": "what do cats eat", "top_n": 1, "return_documents": True,
                             "documents": ["Cats eat fish.", "The market fell."]},
    ("POST", "/v1/embeddings"): {"input": "hi", "model": BUNDLED_MODEL},
    ("POST", "/v2/models/{name:path}/infer"): V2_BODY,
    ("POST", "/v2/models/{name:path}/versions/{version}/infer"): V2_BODY,
    ("POST", "/v2/embed"): {"texts": ["hi"], "input_type": "search_query",
                            "embedding_types": ["float", "ubinary"]},
    ("POST", "/tokenize"): {"inputs": ["hi there"], "return_offsets": True},
    ("POST", "/detokenize"): {"ids": [101, 7592, 102]},
}  # fmt: skip


def concrete(path: str) -> str:
    return path.replace("{name:path}", BUNDLED_MODEL).replace("{version}", "1")


def test_every_public_api_route_reaches_a_replica_through_nginx(cluster):
    """Every route of the public API the app serves (read from the app itself, so a new one is
    covered too) answers through Nginx as the replica answers it directly, and Nginx's access
    log shows a replica answered."""
    routes = [(method, route.path) for route in public_api_routes(create_app(Settings()))
              for method in route.methods]  # fmt: skip
    assert ("POST", "/v1/rerank") in routes and ("GET", "/v2/health/ready") in routes
    assert set(EXAMPLE_BODIES) <= set(routes), set(EXAMPLE_BODIES) - set(routes)
    direct_url = next(iter(cluster.replicas.values()))[0]
    answers = {}
    with httpx.Client(timeout=30) as client:
        for index, (method, path) in enumerate(routes):
            body = EXAMPLE_BODIES.get((method, path), {} if method == "POST" else None)
            headers = {"x-request-id": f"route-{index}"}
            through = client.request(method, cluster.url + concrete(path), json=body,
                                     headers=headers)  # fmt: skip
            direct = client.request(method, direct_url + concrete(path), json=body)
            answers[method, path] = (through, direct)
    entries = access_log(cluster.access_log_path, "route", expect=len(routes))
    for index, ((method, path), (through, direct)) in enumerate(answers.items()):
        assert entries[f"route-{index}"]["upstream_addr"] != "", (method, path)
        assert through.status_code == direct.status_code, (method, path, through.text)
        if method == "GET" or (method, path) in EXAMPLE_BODIES:
            assert through.status_code == 200, (method, path, through.text)
    rerank = answers["POST", "/v1/rerank"][0].json()
    assert rerank["model"] == "rr"
    assert rerank["results"][0]["document"]["text"] in ("Cats eat fish.", "The market fell.")


def infer_count(metrics_url: str) -> float:
    scrape = httpx.get(metrics_url, timeout=10).text
    pattern = r'^batchfit_requests_total\{code="200",endpoint="/v1/infer",error_type=""\} (\S+)$'
    return sum(float(m) for m in re.findall(pattern, scrape, re.MULTILINE))


def test_launcher_prints_the_url_and_every_replica(cluster):
    assert len(cluster.replicas) == 3
    # --replica-ports START: HTTP on START, START+1, START+2; metrics on START+3 to START+5.
    ports = [int(url.rsplit(":", 1)[1]) for url, _ in cluster.replicas.values()]
    metrics = [int(url.rsplit(":", 1)[1].split("/")[0]) for url in cluster.metrics_urls.values()]
    start = ports[0]
    assert ports == [start, start + 1, start + 2] and metrics == [start + 3, start + 4, start + 5]
    for url, _ in cluster.replicas.values():
        assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200
    assert f"batchfit up: {cluster.url} (3 replicas behind nginx" in cluster.output()
    response = httpx.get(f"{cluster.url}/v1/models", timeout=10)
    assert response.status_code == 200
    assert response.json()["models"][0]["name"] == "all-MiniLM-L6-v2"


def test_balancing_every_replica_serves_a_share(cluster):
    before = {name: infer_count(url) for name, url in cluster.metrics_urls.items()}
    run = asyncio.run(
        load_run(cluster.url, requests=LOAD_REQUESTS, clients=LOAD_CLIENTS, prefix="balance")
    )
    assert run.failures == []
    entries = access_log(cluster.access_log_path, "balance", expect=LOAD_REQUESTS)
    assert len(entries) == LOAD_REQUESTS
    share = shares(entries)
    figures = {name: share[cluster.address(name)] for name in cluster.replicas}
    print(f"\nbalancing: {LOAD_REQUESTS} requests, {LOAD_CLIENTS} clients, "
          f"{len(run.failures)} failures, per-replica share {figures}")  # fmt: skip
    for name, url in cluster.metrics_urls.items():
        # Nginx's log and the replica's own counter agree on who served what.
        assert infer_count(url) - before[name] == figures[name]
        assert figures[name] >= LOAD_REQUESTS // 10, figures


def test_request_ids_round_trip(cluster):
    given = httpx.post(
        f"{cluster.url}/v1/infer", json={"inputs": "hi"}, headers={"x-request-id": "trace-42"},
        timeout=30,
    )  # fmt: skip
    assert given.status_code == 200
    assert given.headers["x-request-id"] == "trace-42"
    assert given.json()["request_id"] == "trace-42"
    assert given.headers.get_list("x-request-id") == ["trace-42"]

    generated = httpx.post(f"{cluster.url}/v1/infer", json={"inputs": "hi"}, timeout=30)
    request_id = generated.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert generated.json()["request_id"] == request_id  # the replica saw Nginx's id

    # An id the app would refuse is replaced, not passed on.
    odd = httpx.post(
        f"{cluster.url}/v1/infer", json={"inputs": "hi"}, headers={"x-request-id": "a b"},
        timeout=30,
    )  # fmt: skip
    assert odd.headers["x-request-id"] != "a b"
    assert odd.json()["request_id"] == odd.headers["x-request-id"]


def test_overload_429_passes_through_untouched_and_is_not_retried(cluster):
    body = {"inputs": ["a"] * QUEUE_ITEMS}  # as many items as one replica's queue holds
    direct_url = next(iter(cluster.replicas.values()))[0]
    for attempt in range(3):  # a slowed host may drain a queue before the request arrives
        headers = {"x-request-id": f"overload-{attempt}"}
        with contextlib.ExitStack() as holds:
            for name, (url, _) in cluster.replicas.items():  # wherever Nginx sends it
                holds.enter_context(queue_held(url, QUEUE_ITEMS,
                                               metrics_url=cluster.metrics_urls[name]))  # fmt: skip
            through = httpx.post(f"{cluster.url}/v1/infer", json=body, headers=headers, timeout=30)
            direct = httpx.post(f"{direct_url}/v1/infer", json=body, headers=headers, timeout=30)
        if through.status_code == direct.status_code == 429:
            break
    assert through.status_code == direct.status_code == 429, (through.text, direct.text)
    # The replica's own body, not one of Nginx's (only the queue's count may differ).
    assert through.headers["content-type"] == direct.headers["content-type"]
    waiting = re.compile(rb"\(\d+ of")
    assert waiting.sub(b"", through.content) == waiting.sub(b"", direct.content)
    assert through.json()["error_type"] == "overloaded"
    assert through.json()["request_id"] == headers["x-request-id"]
    assert through.headers["retry-after"] == direct.headers["retry-after"]
    entry = access_log(cluster.access_log_path, "overload")[headers["x-request-id"]]
    assert entry["upstream_status"] == "429"  # one try, no second replica asked
    assert "," not in entry["upstream_addr"]


@pytest.mark.parametrize("path", ["/metrics", "/health/ready", "/health/live", "/docs",
                                  "/openapi.json", "/"])  # fmt: skip
def test_only_the_api_is_routed(cluster, path):
    response = httpx.get(f"{cluster.url}{path}", headers={"x-request-id": "p-1"}, timeout=10)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": "not found", "error_type": "not_found", "request_id": "p-1"}


def test_body_over_the_limit_is_a_json_413_from_nginx(cluster):
    response = httpx.post(
        f"{cluster.url}/v1/infer", content=b"x" * (2 * 2**20 + 1),
        headers={"content-type": "application/json", "x-request-id": "big-1"}, timeout=30,
    )  # fmt: skip
    assert response.status_code == 413
    assert response.json()["error_type"] == "payload_too_large"
    assert response.json()["request_id"] == "big-1"
    entry = access_log(cluster.access_log_path, "big")["big-1"]
    assert entry["upstream_addr"] == ""  # refused by Nginx, never sent to a replica
    # At the limit itself the body passes Nginx and the replica judges it (here: not JSON).
    at_limit = httpx.post(
        f"{cluster.url}/v1/infer", content=b"x" * (2 * 2**20),
        headers={"content-type": "application/json"}, timeout=30,
    )  # fmt: skip
    assert (at_limit.status_code, at_limit.json()["error_type"]) == (400, "invalid_json")


def test_rate_limit_is_a_json_429(cluster, tmp_path):
    upstreams = [cluster.address(name) for name in cluster.replicas]
    with run_nginx(tmp_path, upstreams, rate_limit_rps=1, rate_limit_burst=1) as nginx:
        answers = [
            httpx.get(f"{nginx.url}/v1/models", headers={"x-request-id": f"rl-{i}"}, timeout=10)
            for i in range(4)
        ]
    assert answers[0].status_code == 200
    limited = [a for a in answers if a.status_code == 429]
    assert limited, [a.status_code for a in answers]
    for answer in limited:
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error_type"] == "rate_limited"
        assert answer.json()["request_id"] == answer.headers["x-request-id"]


def test_no_live_replica_is_a_json_503_with_retry_after(tmp_path):
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with run_nginx(tmp_path, dead) as nginx:
        response = httpx.post(
            f"{nginx.url}/v1/infer", json={"inputs": "hi"}, headers={"x-request-id": "dead-1"},
            timeout=30,
        )  # fmt: skip
        entries = nginx.access_entries()
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json() == {
        "error": "no replica is available", "error_type": "unavailable", "request_id": "dead-1",
    }  # fmt: skip
    assert entries[-1]["upstream_status"] == "502, 502"  # both tried, at most 2 tries


def test_gateway_timeout_is_json_and_never_retried(tmp_path):
    slow = [SilentUpstream(), SilentUpstream()]
    try:
        with run_nginx(tmp_path, [u.address for u in slow], read_timeout_s=2) as nginx:
            response = httpx.post(
                f"{nginx.url}/v1/infer", json={"inputs": "hi"},
                headers={"x-request-id": "slow-1"}, timeout=30,
            )  # fmt: skip
            entries = nginx.access_entries()
    finally:
        for upstream in slow:
            upstream.close()
    assert response.status_code == 504
    assert response.json() == {
        "error": "the replica did not answer in time", "error_type": "gateway_timeout",
        "request_id": "slow-1",
    }  # fmt: skip
    # The answer came after the one timeout: a retry would have connected before it.
    assert sum(len(u.connections) for u in slow) == 1
    assert entries[-1]["upstream_status"] == "504"


def test_a_replica_answering_503_is_retried_on_another(cluster, tmp_path):
    body = b'{"error":"draining","error_type":"draining","request_id":"x"}'
    draining = StatusUpstream(503, body, {"content-type": "application/json", "retry-after": "1"})
    try:
        upstreams = [draining.address, cluster.address("replica-0")]
        with run_nginx(tmp_path, upstreams) as nginx:
            answers = [
                httpx.post(f"{nginx.url}/v1/infer", json={"inputs": "hi"}, timeout=30)
                for _ in range(6)
            ]
            entries = nginx.access_entries(expect=6)
    finally:
        draining.close()
    assert [a.status_code for a in answers] == [200] * 6
    retried = [e for e in entries if e["upstream_status"] == "503, 200"]
    assert retried, entries
    assert draining.requests == len(retried)
    assert all(served_by(e) == cluster.address("replica-0") for e in entries)


def test_a_replica_that_cannot_be_connected_to_in_time_is_retried_on_another(tmp_path):
    """A connect timeout (a vanished address, a full accept queue) goes to another replica:
    no replica has seen the request, so nothing runs twice."""
    unreachable = UnreachableUpstream()
    healthy = StatusUpstream(200, b'{"ok":true}', {"content-type": "application/json"})
    try:
        with run_nginx(tmp_path, [unreachable.address, healthy.address]) as nginx:
            # least_conn breaks the tie between idle replicas in turn: one of the first two
            # requests goes to the unreachable one.
            answers = [
                httpx.post(f"{nginx.url}/v1/infer", json={"inputs": "hi"}, timeout=30)
                for _ in range(2)
            ]
            entries = nginx.access_entries(expect=2)
            error_log = (nginx.prefix / "logs" / "error.log").read_text()
    finally:
        unreachable.close()
        healthy.close()
    assert [a.status_code for a in answers] == [200, 200]
    assert healthy.requests == 2
    (retried,) = [e for e in entries if e["upstream_addr"].startswith(unreachable.address)]
    assert retried["upstream_status"] == "504, 200" and served_by(retried) == healthy.address
    assert "upstream timed out (110: Connection timed out) while connecting to upstream" in (
        error_log
    )


# A response head whose body never follows.
PROMISING_HEAD = b"\r\n".join(
    [b"HTTP/1.1 200 OK", b"content-type: application/json", b"content-length: 100", b"", b""]
)


@pytest.mark.parametrize(
    ("sent", "retried"), [(b"", True), (PROMISING_HEAD, False)], ids=["no-head", "head"]
)
def test_a_replica_that_dies_after_its_head_cannot_be_retried(tmp_path, sent, retried):
    """The limit of failover: Nginx takes a request to another replica only until it has read
    a response head (proxy_next_upstream, non_idempotent or not, buffering or not). After that
    the client gets a 200 that is cut off, which is why a replica sends a response's head and
    body in one write (server/one_write.py)."""
    dying = CutOffUpstream(sent)
    healthy = StatusUpstream(200, b'{"ok":true}', {"content-type": "application/json"})
    outcomes = {}
    try:
        with run_nginx(tmp_path, [dying.address, healthy.address]) as nginx:
            # least_conn breaks the tie between idle replicas in turn: one of the first two
            # requests goes to the dying one.
            for n in range(2):
                request_id = f"cut-{n}"
                try:
                    response = httpx.post(
                        f"{nginx.url}/v1/infer", json={"inputs": "hi"},
                        headers={"x-request-id": request_id}, timeout=30,
                    )  # fmt: skip
                    outcomes[request_id] = response.status_code
                except httpx.RemoteProtocolError as exc:
                    outcomes[request_id] = str(exc)
            entries = {e["request_id"]: e for e in nginx.access_entries(expect=2)}
            error_log = (nginx.prefix / "logs" / "error.log").read_text()
    finally:
        dying.close()
        healthy.close()
    assert dying.requests == 1
    (cut,) = [e for e in entries.values() if e["upstream_addr"].startswith(dying.address)]
    if retried:
        assert outcomes[cut["request_id"]] == 200
        assert cut["upstream_status"] == "502, 200" and served_by(cut) == healthy.address
        assert "while reading response header from upstream" in error_log
    else:
        assert outcomes[cut["request_id"]] == (
            "peer closed connection without sending complete message body "
            "(received 0 bytes, expected 100)"
        )
        assert cut["upstream_addr"] == dying.address  # no second replica was asked
        assert cut["status"] == 200  # the head had already gone to the client
        assert "upstream prematurely closed connection while reading upstream" in error_log
    assert [outcomes[rid] for rid in outcomes if rid != cut["request_id"]] == [200]
