"""``--api-workers 2``: API processes in front of one engine behave as one replica. One
shared replica serves a file-gated fake model (it holds batches while a test looks, no
timing) and the bundled model (answers against transformers' own forward, the standard
clients, the output cache shared across the API processes); the drain and the killed engine
each need their own processes."""

from __future__ import annotations

import base64
import contextlib
import http.client
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import tritonclient.http as triton
from transformers import AutoModel, AutoTokenizer

from models.loading import resolve_model_path
from models.spec import BUNDLED_MODEL
from tests.fakes import GATE_ENV, STALL_THE_LOOP
from tests.integration.test_server import SENTENCES, reference  # noqa: F401 (a fixture)
from tests.rawhttp import send_request
from tests.servers import ServerProcess, free_port, run_server, stop_process, wait_ready

pytestmark = pytest.mark.integration

KEY = "workers-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUEUE_ITEMS = 16
# NOTE: one pass at a time: passes side by side finish in either order, and the tests read the
# order the queue dispatched in from the order the model ran them.
GATED = ("--model", "python:tests.fakes:file_gated_model", "--max-wait-ms", "0",
         "--max-batch-size", "1", "--max-queue-items", str(QUEUE_ITEMS),
         "--max-inputs-per-request", str(QUEUE_ITEMS), "--cpu-passes", "1")  # fmt: skip


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def value(text: str, name: str, labels: str = "") -> float:
    pattern = "^" + re.escape(name + (f"{{{labels}}}" if labels else "")) + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def poll(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def infer(url: str, body: dict, timeout_s: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/infer", json=body, headers=AUTH, timeout=timeout_s)


_holds = itertools.count()


def children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sorted(int(child) for child in found)


class Gated:
    def __init__(self, server: ServerProcess, gate: Path) -> None:
        self.server, self.gate, self.url = server, gate, server.url

    @contextlib.contextmanager
    def held(self, pool: ThreadPoolExecutor) -> Iterator[Future]:
        """While inside, the model thread runs a batch that waits for the gate."""
        self.gate.unlink(missing_ok=True)
        running = pool.submit(infer, self.url, {"inputs": [f"hold {next(_holds)}"]}, 120)
        poll(lambda: value(scrape(self.url), "batchfit_open_items") >= 1)
        try:
            yield running
        finally:
            self.gate.touch()
            assert running.result(120).status_code == 200


CACHE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """The shared replica: two API processes, the gated model (the default) and the bundled
    one, an API key and an output cache."""
    folder = tmp_path_factory.mktemp("workers")
    keys = folder / "keys"
    keys.write_text(f"{KEY}\n")
    gate = folder / "gate"
    gate.touch()
    with run_server(
        folder, *GATED, "--model", BUNDLED_MODEL, "--api-workers", "2",
        "--api-key-file", str(keys), "--cache-bytes", str(CACHE_BYTES),
        env={GATE_ENV: str(gate)},
    ) as server:  # fmt: skip
        yield Gated(server, gate)


def test_health_models_status_and_the_api_key(gated):
    url = gated.url
    assert httpx.get(f"{url}/health/live").status_code == 200
    assert httpx.get(f"{url}/health/ready").status_code == 200
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    names = [m["name"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["models"]]
    assert names == ["scripted", BUNDLED_MODEL]
    status = httpx.get(f"{url}/status.json", headers=AUTH).json()
    assert status["ready"] is True and status["draining"] is False
    denied = httpx.post(f"{url}/v1/infer", json={"inputs": "a"})
    assert denied.status_code == 401 and denied.json()["error_type"] == "unauthorized"
    answered = infer(url, {"inputs": ["a b", "c"]})
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["input_tokens"] == 4 + 3


def test_one_scrape_counts_every_request_of_the_replica(gated):
    before = scrape(gated.url)
    num_requests = 8
    for i in range(num_requests):  # a connection each: the API processes share them out
        assert infer(gated.url, {"inputs": [f"count {i}"]}).status_code == 200
    after = scrape(gated.url)
    labels = 'code="200",endpoint="/v1/infer",error_type=""'
    sent = value(after, "batchfit_requests_total", labels) - value(
        before, "batchfit_requests_total", labels
    )
    assert sent == num_requests
    inputs = value(after, "batchfit_inputs_total", 'model="scripted"') - value(
        before, "batchfit_inputs_total", 'model="scripted"'
    )
    assert inputs == num_requests
    # The engine's own series are in the same scrape.
    assert value(after, "batchfit_ready") == 1
    assert value(after, "batchfit_batch_size_count", 'model="scripted"') >= num_requests


def serving_process(conn: http.client.HTTPConnection, workers: list[int]) -> int | None:
    """Which API process accepted ``conn`` (None until one has): the one holding the
    server end of its TCP connection, found through /proc."""
    client_port, server_port = conn.sock.getsockname()[1], conn.sock.getpeername()[1]
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, peer = (int(address.rsplit(":", 1)[1], 16) for address in fields[1:3])
        if (local, peer) == (server_port, client_port):
            inodes.add(f"socket:[{fields[9]}]")
    for pid in workers:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return pid
    return None


def one_connection_per_api_process(port: int, workers: list[int]) -> dict[int, Any]:
    """A kept-alive connection to each API process (new ones until both have one)."""
    held: dict[int, http.client.HTTPConnection] = {}
    for _ in range(200):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        poll(lambda conn=conn: serving_process(conn, workers) is not None)
        owner = serving_process(conn, workers)
        if owner in held:
            conn.close()
        else:
            held[owner] = conn
        if len(held) == len(workers):
            return held
    raise AssertionError("the API processes never both accepted a connection")


def status_samples(url: str, since: float | None = None) -> list[dict]:
    answer = httpx.get(f"{url}/status.json", params={"since": since} if since else None,
                       headers=AUTH, timeout=30)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()["samples"]


def settled(url: str, since: float | None = None) -> float:
    """The time of a sample that has counted every request answered before this call: the
    second sample closed after it, whose gathering of the API processes' requests began
    after it."""
    now = time.time()
    poll(lambda: sum(s["t"] > now for s in status_samples(url, since)) >= 2)
    return status_samples(url, since)[-1]["t"]


def test_the_status_page_shows_the_engine_and_every_api_process(gated):
    """Its batch, memory and cache figures are the engine's; its request counts are those
    of both API processes."""
    url = gated.url
    for _ in range(2):  # a cached answer and its repeat: the cache has bytes and a hit
        assert minilm_outputs(url, inputs=["The status page's cached sentence."]).shape == (1, 384)
    workers = children(gated.server.process.pid)
    held = one_connection_per_api_process(gated.server.port, workers)
    try:
        start = settled(url)  # the requests from now on count in the samples after it
        sent = {pid: 2 + i for i, pid in enumerate(held)}  # unequal: each process is seen
        for pid, conn in held.items():
            for i in range(sent[pid]):
                body = json.dumps({"inputs": [f"status {pid} {i}"]})
                conn.request(
                    "POST", "/v1/infer", body, {**AUTH, "Content-Type": "application/json"}
                )
                answer = conn.getresponse()
                assert answer.status == 200, answer.read()
                answer.read()
            assert serving_process(conn, workers) == pid  # still the same process
    finally:
        for conn in held.values():
            conn.close()
    settled(url, start)
    samples = [{"t": start}, *status_samples(url, start)]
    counted = sum(
        round(now["requests_per_s"] * (now["t"] - last["t"]))
        for last, now in itertools.pairwise(samples)
    )
    assert counted == sum(sent.values())
    newer = samples[1:]
    assert sum(s["batches"] for s in newer) >= sum(sent.values())
    assert any(s["batch_size"] for s in newer) and any(s["padded_tokens"] for s in newer)
    latest = newer[-1]
    for field in ("memory_free_bytes", "predicted_peak_bytes", "measured_peak_bytes"):
        assert latest[field], field
    assert latest["cache_hit_rate"] is not None and latest["cache_bytes"] > 0
    assert any(s["latency_p50_ms"] for s in newer)


def test_priorities_order_the_queue(gated):
    with ThreadPoolExecutor(3) as pool, gated.held(pool):
        low = pool.submit(infer, gated.url, {"inputs": ["low"], "priority": 0})
        poll(lambda: value(scrape(gated.url), "batchfit_queue_depth") == 1)
        high = pool.submit(infer, gated.url, {"inputs": ["high"], "priority": 5})
        poll(lambda: value(scrape(gated.url), "batchfit_queue_depth") == 2)
    assert high.result(60).json()["outputs"][0] < low.result(60).json()["outputs"][0]


def test_a_full_queue_is_429_and_a_deadline_504_that_frees_its_place(gated):
    with ThreadPoolExecutor(3) as pool, gated.held(pool):
        late = infer(gated.url, {"inputs": ["late"], "timeout_s": 0.2})
        assert late.status_code == 504, late.text
        assert late.json()["error_type"] == "deadline_exceeded"
        poll(lambda: value(scrape(gated.url), "batchfit_queue_depth") == 0)
        fill = [f"fill {i}" for i in range(QUEUE_ITEMS)]  # distinct: no sharing
        filling = pool.submit(infer, gated.url, {"inputs": fill})
        poll(lambda: value(scrape(gated.url), "batchfit_queue_depth") == QUEUE_ITEMS)
        refused = infer(gated.url, {"inputs": ["one more"]})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error_type"] == "overloaded"
        assert "retry-after" in refused.headers
    assert filling.result(60).status_code == 200


def test_a_client_gone_takes_its_queued_inputs_out_of_the_engine(gated):
    labels = 'stage="queued"'
    with ThreadPoolExecutor(3) as pool, gated.held(pool):
        before = value(scrape(gated.url), "batchfit_cancelled_items_total", labels)
        body = b'{"inputs": ["gone 1", "gone 2", "gone 3"]}'
        sock = send_request(gated.server.port, body, headers=AUTH)
        poll(lambda: value(scrape(gated.url), "batchfit_queue_depth") == 3)
        sock.close()
        poll(lambda: value(scrape(gated.url), "batchfit_queue_depth") == 0)
        after = value(scrape(gated.url), "batchfit_cancelled_items_total", labels)
    assert after - before == 3


# -- the bundled model through the two API processes


def test_answers_match_the_reference_through_every_protocol(gated, reference):  # noqa: F811
    minilm = gated.server
    native = infer(minilm.url, {"inputs": SENTENCES, "model": BUNDLED_MODEL})
    assert native.status_code == 200, native.text
    outputs = np.asarray(native.json()["outputs"], dtype=np.float32)
    assert np.allclose(outputs, reference, atol=1e-4)
    with openai.OpenAI(base_url=f"{minilm.url}/v1", api_key=KEY, max_retries=0) as client:
        for encoding_format in ("float", "base64"):
            answer = client.embeddings.create(
                model=BUNDLED_MODEL, input=SENTENCES, encoding_format=encoding_format
            )
            vectors = np.asarray(
                [
                    np.frombuffer(base64.b64decode(d.embedding), dtype=np.float32)
                    if encoding_format == "base64"
                    else d.embedding
                    for d in answer.data
                ],
                dtype=np.float32,
            )
            assert np.allclose(vectors, reference, atol=1e-4)
    v2 = triton.InferenceServerClient(f"127.0.0.1:{minilm.port}", network_timeout=60)
    try:
        assert v2.is_server_ready(headers=dict(AUTH))
        text = triton.InferInput("text", [len(SENTENCES)], "BYTES")
        text.set_data_from_numpy(np.asarray(SENTENCES, dtype=object))
        result = v2.infer(BUNDLED_MODEL, [text], headers=dict(AUTH))  # it adds to them
        assert np.allclose(result.as_numpy("embedding"), reference, atol=1e-4)
    finally:
        v2.close()


@pytest.fixture(scope="module")
def embed():
    """The bundled model's embeddings by transformers' own forward, mean pooling, with the
    tokenizer cutting over-long texts from ``side``."""
    path = resolve_model_path(BUNDLED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()

    def run(texts: list[str], side: str = "right") -> np.ndarray:
        tokenizer.truncation_side = side
        encoded = tokenizer(
            texts, padding=True, truncation=True, max_length=256, return_tensors="pt"
        )
        with torch.inference_mode():
            hidden = model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=1).numpy()

    return run


def minilm_outputs(url: str, **body) -> np.ndarray:
    answer = infer(url, {"model": BUNDLED_MODEL, **body})
    assert answer.status_code == 200, answer.text
    return np.asarray(answer.json()["outputs"], dtype=np.float32)


def engine_counts(url: str) -> dict[str, float]:
    text = scrape(url)
    labels = f'model="{BUNDLED_MODEL}"'
    names = ("batchfit_cache_hits_total", "batchfit_cache_misses_total",
             "batchfit_deduplicated_inputs_total", "batchfit_batch_size_sum")  # fmt: skip
    return {name: value(text, name, labels) for name in names}


def test_dimensions_and_truncation_direction_reach_the_engine(gated, embed):
    filler = " ".join(f"word{i % 50}" for i in range(400))  # past the 256-token maximum
    long = f"Rivers and mountains of the north. {filler} Databases index rows by their keys."
    cut = minilm_outputs(gated.url, inputs=[long], dimensions=128)
    want = embed([long])[0][:128]
    assert cut.shape == (1, 128)
    assert float(np.dot(cut[0], want / np.linalg.norm(want))) > 0.9999  # renormalised
    left = minilm_outputs(gated.url, inputs=[long], truncation_direction="left")
    assert float(np.dot(left[0], embed([long], side="left")[0])) > 0.9999
    right = minilm_outputs(gated.url, inputs=[long])
    assert float(np.dot(right[0], embed([long])[0])) > 0.9999
    assert not np.array_equal(left, right)  # each side's own answer


def test_the_engine_caches_for_every_api_process_and_shares_inputs_in_flight(gated, embed):
    texts = [f"Cached once for the whole replica, sentence {i}." for i in range(4)]
    first = minilm_outputs(gated.url, inputs=texts)
    before = engine_counts(gated.url)
    for _ in range(6):  # a connection each: both API processes ask
        assert np.array_equal(minilm_outputs(gated.url, inputs=texts), first)
    after = engine_counts(gated.url)
    assert after["batchfit_cache_hits_total"] - before["batchfit_cache_hits_total"] == 6 * 4
    assert after["batchfit_batch_size_sum"] == before["batchfit_batch_size_sum"]  # none ran
    for got, want in zip(first, embed(texts), strict=True):
        assert float(np.dot(got, want)) > 0.9999
    # Concurrent duplicates through both API processes: one computation while the model
    # thread is held, every other request waits for it.
    text = "Eight clients of two API processes ask for this at once."
    with ThreadPoolExecutor(9) as pool, gated.held(pool):
        before = engine_counts(gated.url)
        asked = [pool.submit(minilm_outputs, gated.url, inputs=[text]) for _ in range(8)]
        poll(lambda: value(scrape(gated.url), "batchfit_active_infer_requests") == 1 + 8)
    answers = [future.result(60) for future in asked]
    after = engine_counts(gated.url)
    assert all(np.array_equal(answer, answers[0]) for answer in answers)
    assert float(np.dot(answers[0][0], embed([text])[0])) > 0.9999
    assert after["batchfit_batch_size_sum"] - before["batchfit_batch_size_sum"] == 1
    shared = (
        after["batchfit_deduplicated_inputs_total"] - before["batchfit_deduplicated_inputs_total"]
    )
    assert shared == 7


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_api_processes_never_load_torch(gated):
    """They validate, tokenize and answer; the engine alone holds the models, and torch with
    them (some 200 MiB of memory and 2 s of start-up an API process does without). After
    every protocol, dimensions and truncation have been served above."""
    workers = children(gated.server.process.pid)
    assert len(workers) == 2
    assert maps_torch(gated.server.process.pid)
    assert not any(maps_torch(pid) for pid in workers)


def test_a_killed_api_process_is_started_again_and_the_replica_serves_on(gated):
    """Last on the shared replica: it leaves the replica as it found it, with a new process."""
    server = gated.server
    first, second = children(server.process.pid)
    os.kill(first, signal.SIGKILL)
    poll(lambda: first not in (now := children(server.process.pid)) and len(now) == 2)
    replacement = next(p for p in children(server.process.pid) if p != second)
    for i in range(10):  # new connections: both API processes answer some
        assert infer(server.url, {"inputs": [f"after {i}"]}).status_code == 200
    poll(lambda: httpx.get(f"{server.url}/health/ready").status_code == 200)
    assert server.process.poll() is None
    assert replacement != first
    assert "starting it again" in server.log()


# -- drain and failover, two API processes


def gated_replica(tmp_path: Path, *flags: str) -> contextlib.AbstractContextManager:
    gate = tmp_path / "gate"
    gate.touch()
    return run_server(tmp_path, *GATED, "--api-workers", "2", *flags, env={GATE_ENV: str(gate)})


def test_the_metrics_port_and_the_admin_profiler_answer_for_the_whole_replica(tmp_path):
    # The engine serves --metrics-port (every process's series, merged) and owns the model
    # thread the admin profiler traces; the API processes ask it.
    metrics_port, token = free_port(), "admin-token"
    admin = {"Authorization": f"Bearer {token}"}
    with gated_replica(
        tmp_path, "--metrics-port", str(metrics_port), "--admin-token", token,
        "--profile-dir", str(tmp_path / "traces"),
    ) as server:  # fmt: skip
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        assert httpx.get(f"{server.url}/metrics").status_code == 404  # off the public port
        before = httpx.get(metrics_url, timeout=30).text
        num_requests = 8
        for i in range(num_requests):  # a connection each: the API processes share them out
            assert infer(server.url, {"inputs": [f"count {i}"]}).status_code == 200
        after = httpx.get(metrics_url, timeout=30).text
        labels = 'code="200",endpoint="/v1/infer",error_type=""'
        counted = value(after, "batchfit_requests_total", labels)
        assert counted - value(before, "batchfit_requests_total", labels) == num_requests
        assert value(after, "batchfit_batch_size_count", 'model="scripted"') >= num_requests

        url = f"{server.url}/admin/profile"
        assert httpx.post(url, json={"num_batches": 2}).status_code == 401
        armed = httpx.post(url, json={"num_batches": 2}, headers=admin)
        assert armed.status_code == 202 and armed.json()["state"] == "armed", armed.text
        for _ in range(4):  # whichever API process answers, the engine's profiler is armed
            busy = httpx.post(url, json={"num_batches": 1}, headers=admin)
            assert busy.status_code == 409 and busy.json()["error_type"] == "profile_busy"
        for i in range(2):  # one request at a time: two batches
            assert infer(server.url, {"inputs": [f"traced {i}"]}).status_code == 200
        poll(lambda: httpx.get(url, headers=admin).json()["state"] == "idle", 30)
        state = httpx.get(url, headers=admin).json()
    assert state["last_error"] is None and state["last_trace_path"] == armed.json()["trace_path"]
    events = json.loads(Path(state["last_trace_path"]).read_text())["traceEvents"]
    assert len([e for e in events if e.get("name", "").startswith("batchfit_batch[")]) == 2


def test_a_hung_api_process_exits_and_is_started_again_while_the_other_serves(tmp_path):
    with gated_replica(tmp_path, "--hang-timeout-s", "2") as server, ThreadPoolExecutor(1) as pool:
        workers = set(children(server.process.pid))
        stalled = pool.submit(infer, server.url, {"inputs": [STALL_THE_LOOP]}, 60)
        poll(lambda: len(set(children(server.process.pid)) - workers) == 1, 30)  # replaced
        with pytest.raises(httpx.TransportError):  # its connection went with it
            stalled.result()
        poll(lambda: len(children(server.process.pid)) == 2, 30)
        for i in range(4):  # a connection each: either API process
            assert infer(server.url, {"inputs": [f"after {i}"]}).status_code == 200
        assert server.process.poll() is None  # the engine serves on
    log = server.log()
    assert "Timeout (0:00:02)!" in log and "in scripted_items" in log
    assert "exited with 1; starting it again" in log


def test_sigterm_drains_through_the_api_processes_then_every_process_exits_0(tmp_path):
    with (
        gated_replica(tmp_path, "--drain-timeout-s", "120") as server,
        ThreadPoolExecutor(4) as pool,
    ):
        workers = children(server.process.pid)
        assert len(workers) == 2
        gated = Gated(server, tmp_path / "gate")
        gated.gate.unlink()
        held = [pool.submit(infer, server.url, {"inputs": [f"hold {i}"]}, 120) for i in range(3)]
        poll(lambda: value(scrape(server.url), "batchfit_active_infer_requests") == 3)
        server.process.send_signal(signal.SIGTERM)
        for _ in range(4):  # whichever API process answers
            ready = httpx.get(f"{server.url}/health/ready", timeout=10)
            assert ready.status_code == 503 and ready.json()["error_type"] == "draining"
            refused = infer(server.url, {"inputs": ["new"]})
            assert refused.status_code == 503 and refused.json()["error_type"] == "draining"
        assert not any(f.done() for f in held)
        gated.gate.touch()
        for future in held:
            assert future.result(120).status_code == 200
        assert server.process.wait(60) == 0
        poll(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers))
    assert "drained: every admitted request was answered" in server.log()
    assert "Traceback" not in server.log()


def test_a_killed_engine_ends_every_request_with_503_and_the_api_processes_exit(tmp_path):
    with gated_replica(tmp_path) as server, ThreadPoolExecutor(4) as pool:
        workers = children(server.process.pid)
        (tmp_path / "gate").unlink()
        held = [pool.submit(infer, server.url, {"inputs": [f"hold {i}"]}, 60) for i in range(4)]
        poll(lambda: value(scrape(server.url), "batchfit_active_infer_requests") == 4)
        server.process.send_signal(signal.SIGKILL)
        assert server.process.wait(30) != 0
        for future in held:
            answer = future.result(60)  # a hang would raise here instead
            assert answer.status_code == 503, answer.text
            assert answer.json()["error_type"] == "engine_unavailable"
        # Well within the 30 s an API process still starting up waits for the engine's
        # first word: one that was starting when the engine died stops at once too.
        poll(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 15)
        with pytest.raises(httpx.TransportError):  # nothing listens any more
            httpx.get(f"{server.url}/health/live", timeout=5)


def test_a_hung_engine_fails_liveness_in_every_api_process_until_it_answers_again(tmp_path):
    # The API processes answer HTTP on their own, so their liveness must speak for the engine:
    # stopped (SIGSTOP), it says nothing; the kubelet or `batchfit up` then restarts the replica.
    def answers(path: str, times: int = 8) -> list[int]:
        # One connection each: the listening socket hands them to either API process.
        return [httpx.get(f"{server.url}{path}", timeout=10).status_code for _ in range(times)]

    with gated_replica(tmp_path) as server:
        assert infer(server.url, {"inputs": ["before"]}).status_code == 200
        assert set(answers("/health/live") + answers("/v2/health/live")) == {200}
        engine = server.process.pid
        os.kill(engine, signal.SIGSTOP)
        try:
            poll(lambda: set(answers("/health/live")) == {503}, timeout_s=60)
            hung = httpx.get(f"{server.url}/health/live", timeout=10)
            v2 = httpx.get(f"{server.url}/v2/health/live", timeout=10)
        finally:
            os.kill(engine, signal.SIGCONT)
        poll(lambda: set(answers("/health/live") + answers("/v2/health/live")) == {200}, 60)
        after = infer(server.url, {"inputs": ["after"]})
    assert hung.json()["error_type"] == "engine_unavailable", hung.text
    assert "has said nothing for" in hung.json()["error"] and hung.headers["retry-after"] == "1"
    assert (v2.status_code, v2.json()) == (503, {"live": False})
    assert after.status_code == 200, after.text


def test_a_hung_forward_pass_in_the_engine_fails_liveness_in_every_api_process(tmp_path):
    def answers(times: int = 8) -> set[int]:  # a connection each: either API process
        return {httpx.get(f"{server.url}/health/live", timeout=10).status_code
                for _ in range(times)}  # fmt: skip

    with (
        gated_replica(tmp_path, "--forward-timeout-s", "1") as server,
        ThreadPoolExecutor(1) as pool,
    ):
        (tmp_path / "gate").unlink()
        held = pool.submit(infer, server.url, {"inputs": ["hold it"]}, 60)
        poll(lambda: answers() == {503}, 30)
        hung = httpx.get(f"{server.url}/health/live", timeout=10)
        (tmp_path / "gate").touch()
        assert held.result(60).status_code == 200
        poll(lambda: answers() == {200}, 30)
    assert hung.json()["error_type"] == "model_hung", hung.text
    assert "--forward-timeout-s 1" in hung.json()["error"]


# -- where the replica runs from


@contextlib.contextmanager
def batchfit_serve(cwd: Path, log_path: Path, *flags: str, env: dict[str, str] | None = None):
    """``batchfit serve`` as a user runs it (the console script) from ``cwd``."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("batchfit")), "serve", "--port", str(port),
             "--model", "python:bench.noop:create", "--api-workers", "2", *flags],
            cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )  # fmt: skip
    try:
        yield ServerProcess(f"http://127.0.0.1:{port}", port, process, log_path)
    finally:
        stop_process(process)


def test_api_processes_start_from_a_folder_holding_folders_named_like_the_packages(tmp_path):
    home = tmp_path / "home"
    for name in ("models", "server", "batching"):
        (home / name).mkdir(parents=True)
    with batchfit_serve(home, tmp_path / "serve.log") as server:
        wait_ready(server, 120)
        answer = httpx.post(f"{server.url}/v1/infer", json={"inputs": "hi"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert "starting it again" not in server.log()


def test_api_processes_that_cannot_start_end_the_replica_instead_of_looping(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    # Every API process (and only they) dies at start, as a broken install would make it.
    (site / "sitecustomize.py").write_text(
        "import os, sys\nif 'server.engine.worker' in sys.orig_argv:\n    os._exit(3)\n"
    )
    with batchfit_serve(tmp_path, tmp_path / "serve.log", env={"PYTHONPATH": str(site)}) as server:
        assert server.process.wait(120) == 1
    log = server.log()
    assert log.count("exited with 3 before it started") == 1, log
    assert "exited with 3 before it started, 3 times in a row; stopping the replica" in log
    assert log.count("exited with 3; starting it again") == 2, log
