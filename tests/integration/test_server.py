"""The real server: bundled model, real uvicorn on a loopback port, real HTTP."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from models.loading import resolve_model_path
from models.spec import BUNDLED_MODEL
from tests.busy_threads import held_threads
from tests.rawhttp import (
    CountingReader,
    data_segments_received,
    get,
    read_response,
    send_request,
)
from tests.servers import run_server, when_queue_full

pytestmark = pytest.mark.integration

# The label of the bundled model's series (batching metrics are per model).
MODEL = f'model="{BUNDLED_MODEL}"'
QUEUE_ITEMS = 64

SENTENCES = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Batching requests makes inference on accelerators much cheaper.",
    "hello",
    "Out-of-memory errors are caught and the batch is split in two.",
    "Sentence embeddings map text to vectors in a shared space; similar texts land close "
    "together, which makes them useful for search, clustering and deduplication.",
    "¿Dónde está la biblioteca?",
    "1 2 3 4 5 6 7 8 9 10",
]


@pytest.fixture(scope="module")
def reference():
    """Embeddings computed directly with transformers and mean pooling (not our code path)."""
    path = resolve_model_path(BUNDLED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    encoded = tokenizer(
        SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt"
    )
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=1).numpy()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(
        tmp_path_factory.mktemp("server"),
        "--max-queue-items", str(QUEUE_ITEMS), "--max-inputs-per-request", str(QUEUE_ITEMS),
        "--max-wait-ms", "5",
    ) as server:  # fmt: skip
        yield server


def cosine(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def metric(scrape: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)"
    match = re.search(pattern, scrape)
    assert match, f"{name}{{{labels}}} not in scrape"
    return float(match.group(1))


def test_not_ready_while_loading_then_ready(server):
    assert 503 in server.ready_answers
    assert server.ready_answers[-1] == 200
    log = server.log()
    assert "ready in" in log
    # A serving process freezes what start-up left out of garbage collection (server/heap.py).
    frozen = re.search(r"(\d+) start-up objects frozen out of garbage collection", log)
    assert frozen and int(frozen.group(1)) > 100_000, log[-2000:]
    assert log.index("frozen out of garbage collection") < log.index("ready in")


def test_embeddings_match_reference(server, reference):
    response = httpx.post(f"{server.url}/v1/infer", json={"inputs": SENTENCES}, timeout=60)
    assert response.status_code == 200
    body = response.json()
    assert body["model"] == BUNDLED_MODEL
    assert len(body["outputs"]) == len(SENTENCES)
    for output, expected in zip(body["outputs"], reference, strict=True):
        assert len(output) == 384
        assert cosine(output, expected) >= 0.9999
    assert body["usage"]["input_tokens"] > len(SENTENCES)
    assert body["request_id"] == response.headers["x-request-id"]


def test_concurrent_requests_are_batched_and_answered_in_order(server, reference):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

            async def one_client(k):
                results = []
                for round_ in range(4):
                    # Each request carries 1-3 sentences, rotated so orders differ.
                    picks = [(k + round_ + j) % len(SENTENCES) for j in range(1 + k % 3)]
                    response = await client.post(
                        "/v1/infer", json={"inputs": [SENTENCES[i] for i in picks]}
                    )
                    results.append((picks, response))
                return results

            before = (await client.get("/metrics")).text
            all_results = await asyncio.gather(*(one_client(k) for k in range(32)))
            after = (await client.get("/metrics")).text
            return before, [r for results in all_results for r in results], after

    before, results, after = asyncio.run(main())
    for picks, response in results:
        assert response.status_code == 200, response.text
        outputs = response.json()["outputs"]
        assert len(outputs) == len(picks)
        for i, output in zip(picks, outputs, strict=True):
            assert cosine(output, reference[i]) >= 0.9999
    items = sum(len(picks) for picks, _ in results)
    batches = metric(after, "batchfit_batch_size_count", MODEL) - metric(
        before, "batchfit_batch_size_count", MODEL
    )
    batched_items = metric(after, "batchfit_batch_size_sum", MODEL) - metric(
        before, "batchfit_batch_size_sum", MODEL
    )
    assert batched_items == items
    assert batches < items / 2, f"{batches} batches for {items} items: little batching"
    singles = metric(after, "batchfit_batch_size_bucket", f'le="1.0",{MODEL}') - metric(
        before, "batchfit_batch_size_bucket", f'le="1.0",{MODEL}'
    )
    assert singles < batches  # some batches held more than one item
    # On this CPU, with memory to spare, passes ran side by side while work waited, and their
    # outputs match the reference above as those of passes alone do.
    assert re.search(r"forward passes: up to \d+ at a time while work waits", server.log())
    beside = metric(after, "batchfit_side_by_side_batches_total") - metric(
        before, "batchfit_side_by_side_batches_total"
    )
    assert 0 < beside <= batches


def test_a_model_computing_on_the_cpu_moves_no_thread(server):
    """Its forward passes are heavy: the model thread stays off the event loop's CPU
    (``batching/affinity.py``; the light no-op model's case: ``test_colocation``)."""
    for i in range(20):
        httpx.post(f"{server.url}/v1/infer", json={"inputs": [f"one {i}"]}).raise_for_status()
    assert held_threads(server.process.pid) == {}
    assert "the model thread shares CPU" not in server.log()


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({"inputs": []}, 400, "empty_input"),
        ({"inputs": [""]}, 400, "empty_input"),
        ({"inputs": [1]}, 422, "invalid_request"),
        ({"inputs": "a", "typo": True}, 422, "invalid_request"),
        ({"inputs": ["a"] * (QUEUE_ITEMS + 1)}, 413, "too_many_inputs"),
        ({"inputs": "word " * 400, "truncate": False}, 413, "input_too_long"),
        ({"inputs": "a", "timeout_s": 1e-9}, 504, "deadline_exceeded"),
    ],
)
def test_error_cases(server, body, status, error_type):
    response = httpx.post(f"{server.url}/v1/infer", json=body, timeout=30)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["error_type"] == error_type
    assert payload["request_id"] == response.headers["x-request-id"]
    assert "Traceback" not in payload["error"]


def test_a_full_queue_is_429_with_retry_after(server):
    def send():
        inputs = [f"a {i}" for i in range(QUEUE_ITEMS)]
        return httpx.post(f"{server.url}/v1/infer", json={"inputs": inputs}, timeout=30)

    response = when_queue_full(server.url, QUEUE_ITEMS, send, lambda r: r.status_code)
    payload = response.json()
    assert payload["error_type"] == "overloaded" and "queue is full" in payload["error"]
    assert payload["request_id"] == response.headers["x-request-id"]
    assert int(response.headers["retry-after"]) >= 1


def test_unparsable_and_oversized_bodies(server):
    bad = httpx.post(
        f"{server.url}/v1/infer",
        content=b'{"inputs": [',
        headers={"content-type": "application/json"},
    )
    assert (bad.status_code, bad.json()["error_type"]) == (400, "invalid_json")
    huge = httpx.post(
        f"{server.url}/v1/infer", content=b"x" * (3 * 2**20),
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert (huge.status_code, huge.json()["error_type"]) == (413, "payload_too_large")
    assert httpx.post(f"{server.url}/v1/infer", json={"inputs": "fine"}).status_code == 200


def test_truncation_by_default(server):
    response = httpx.post(f"{server.url}/v1/infer", json={"inputs": "word " * 400}, timeout=30)
    assert response.status_code == 200
    assert response.json()["usage"]["input_tokens"] == 256


def test_models_and_metrics_endpoints(server):
    card = httpx.get(f"{server.url}/v1/models").json()["models"][0]
    assert card == {
        "name": BUNDLED_MODEL, "task": "embed", "device": "cpu", "dtype": "float32",
        "max_input_tokens": 256, "output_dim": 384, "architecture": "encoder",
        "pooling": "mean", "normalize": True, "prompts": {}, "default_prompt_name": None,
        "activation": None, "truncation_direction": "right", "context_length": None,
    }  # fmt: skip
    scrape = httpx.get(f"{server.url}/metrics").text
    for name in ("batchfit_requests_total", "batchfit_request_duration_seconds_bucket",
                 "batchfit_queue_depth", "batchfit_batch_size_bucket"):  # fmt: skip
        assert name in scrape
    assert httpx.get(f"{server.url}/health/live").json() == {"status": "live"}


@pytest.mark.parametrize(
    ("send", "status"),
    [
        (lambda port: send_request(port, json.dumps({"inputs": ["one", "two words"]}).encode()),
         200),
        (lambda port: send_request(port, json.dumps({"inputs": []}).encode()), 400),
        (lambda port: send_request(port, content_length=False,  # the middleware's own 413
                                   headers={"Content-Length": str(3 * 2**20)}), 413),
        (lambda port: get(port, "/v1/models"), 200),
        (lambda port: get(port, "/health/ready"), 200),
    ],
)  # fmt: skip
def test_every_response_leaves_the_server_in_one_write(server, send, status):
    """Head and body in one send(), counted by the kernel as the TCP segments that carried
    data to this client: a replica that dies between two writes leaves Nginx a head without
    its body, which it cannot retry elsewhere."""
    sock = send(server.port)
    reader = CountingReader(sock)
    try:
        answer_status, headers, body = read_response(reader)  # type: ignore[arg-type]
        segments, received = data_segments_received(sock)
    finally:
        sock.close()
    assert answer_status == status
    assert len(body) == int(headers["content-length"]) > 0
    # The kernel counted this answer (and a FIN's sequence number, where the server closed).
    assert reader.num_bytes <= received <= reader.num_bytes + 1
    assert reader.num_bytes > len(body)
    assert segments == 1, f"the answer came in {segments} segments"
