"""Several models in one real replica: the bundled embedder, a classifier and a cross-encoder
(random weights from small configs) served together under concurrent traffic; reranking over
raw HTTP against the documented shape; model routing in every protocol; and two models sharing
one memory limit under a burst."""

from __future__ import annotations

import asyncio
import random

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from models.spec import BUNDLED_MODEL
from models.testing import save_tiny_model
from tests.integration.test_real_oom import metric
from tests.reference import cosine, reference_embeddings
from tests.servers import run_server

pytestmark = pytest.mark.integration

MAX_DOCUMENTS = 16
WORDS = [
    "the", "cat", "sat", "on", "a", "mat", "while", "dogs", "bark", "at", "night", "and",
    "markets", "fall", "in", "spring", "rain",
]  # fmt: skip


def texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    # Some past the tiny models' 128 tokens, so truncation is part of what is compared.
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 20, 60, 200])))
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    return {
        "clf": save_tiny_model(root / "clf", task="classify", seed=1),
        "rr": save_tiny_model(root / "rr", task="rerank", seed=2),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders):
    with run_server(
        tmp_path_factory.mktemp("multi-server"),
        "--model", BUNDLED_MODEL, "--model", f"clf={folders['clf']}",
        "--model", f"rr={folders['rr']}", "--max-inputs-per-request", str(MAX_DOCUMENTS),
        "--max-rerank-documents", str(MAX_DOCUMENTS),
        "--max-wait-ms", "2",
    ) as server:  # fmt: skip
        yield server


def expected_labels(folder, inputs):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    batch = tokenizer(inputs, truncation=True, max_length=128, padding=True, return_tensors="pt")
    with torch.inference_mode():
        probs = torch.softmax(model(**batch).logits, dim=-1)
    top2 = probs.topk(2, dim=-1)
    labels = [model.config.id2label[int(i)] for i in top2.indices[:, 0]]
    margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    return labels, top2.values[:, 0].tolist(), margins


def expected_scores(folder, query, documents):
    """transformers' own forward pass with the sigmoid, as sentence-transformers scores."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    batch = tokenizer(
        [query] * len(documents), documents, truncation=True, max_length=128, padding=True,
        return_tensors="pt",
    )  # fmt: skip
    with torch.inference_mode():
        scores = torch.sigmoid(model(**batch).logits[:, 0]).tolist()
    return scores, [int(n) for n in batch["attention_mask"].sum(dim=1)]


def test_three_models_under_concurrent_traffic_match_each_model_alone(server, folders):
    embed_inputs = [texts(seed, 3) for seed in range(12)]
    clf_inputs = [texts(100 + seed, 3) for seed in range(12)]
    queries = [(f"what happens at night {i}", texts(200 + i, 5)) for i in range(12)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            calls = []
            for i in range(12):  # interleaved, so batches of the three models alternate
                body = {"inputs": embed_inputs[i]} | ({"model": BUNDLED_MODEL} if i % 2 else {})
                calls.append(client.post("/v1/infer", json=body))
                calls.append(client.post("/v1/infer", json={"inputs": clf_inputs[i],
                                                            "model": "clf"}))  # fmt: skip
                query, documents = queries[i]
                calls.append(client.post("/v1/rerank", json={"query": query,
                                                             "documents": documents}))  # fmt: skip
            return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * len(responses), [
        r.text for r in responses if r.status_code != 200
    ]
    embeds, clfs, reranks = responses[0::3], responses[1::3], responses[2::3]
    assert {r.json()["model"] for r in embeds} == {BUNDLED_MODEL}
    vectors = [v for r in embeds for v in r.json()["outputs"]]
    reference = reference_embeddings([t for group in embed_inputs for t in group])
    assert min(cosine(a, b) for a, b in zip(vectors, reference, strict=True)) >= 0.9999

    assert {r.json()["model"] for r in clfs} == {"clf"}
    outputs = [o for r in clfs for o in r.json()["outputs"]]
    labels, scores, margins = expected_labels(folders["clf"], [t for g in clf_inputs for t in g])
    assert min(margins) > 1e-4  # no near-tie that float noise could flip
    assert [o["label"] for o in outputs] == labels
    assert [o["score"] for o in outputs] == pytest.approx(scores, abs=1e-5)

    for response, (query, documents) in zip(reranks, queries, strict=True):
        body = response.json()
        assert body["model"] == "rr"  # the first reranker, when no model is named
        expected, lengths = expected_scores(folders["rr"], query, documents)
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        assert [got[i] for i in range(len(documents))] == pytest.approx(expected, abs=1e-5)
        assert body["usage"]["input_tokens"] == sum(lengths)

    scrape = httpx.get(f"{server.url}/metrics").text
    for model in (BUNDLED_MODEL, "clf", "rr"):
        assert metric(scrape, "batchfit_batch_size_count", f'model="{model}"') > 0
        assert metric(scrape, "batchfit_inputs_total", f'model="{model}"') > 0


def rerank(server, **body):
    return httpx.post(f"{server.url}/v1/rerank", json=body, timeout=60)


def test_rerank_orders_by_score_and_honours_top_n_and_return_documents(server, folders):
    query, documents = "cats at night", texts(300, 6)
    full = rerank(server, query=query, documents=documents, model="rr")
    assert full.status_code == 200
    body = full.json()
    assert set(body) == {"model", "results", "usage", "request_id"}
    assert body["request_id"] == full.headers["x-request-id"]
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(6))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert all(set(r) == {"index", "relevance_score"} for r in results)  # no documents unasked
    assert all(0 < s < 1 for s in scores)

    top = rerank(server, query=query, documents=documents, top_n=2, return_documents=True).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    for result in top["results"]:
        assert result["document"] == {"text": documents[result["index"]]}
    assert top["usage"] == body["usage"]


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({"query": "q", "documents": []}, 400, "empty_input"),
        ({"query": "q", "documents": ["a", ""]}, 400, "empty_input"),
        ({"query": "", "documents": ["a"]}, 400, "empty_input"),
        ({"query": "q", "documents": ["a"] * (MAX_DOCUMENTS + 1)}, 413, "too_many_inputs"),
        ({"query": "q", "documents": ["a", "b"], "top_n": 0}, 422, "invalid_top_n"),
        ({"query": "q", "documents": ["a", "b"], "top_n": -1}, 422, "invalid_top_n"),
        ({"query": "q", "documents": ["a"], "top_n": "1"}, 422, "invalid_request"),
        ({"documents": ["a"]}, 422, "invalid_request"),
        ({"query": "q", "documents": ["a"], "model": "nope"}, 404, "model_not_found"),
        ({"query": "q", "documents": ["a"], "model": "clf"}, 400, "wrong_task"),
    ],
)  # fmt: skip
def test_rerank_errors(server, body, status, error_type):
    response = rerank(server, **body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["error_type"] == error_type
    assert error["error"] and error["request_id"]


def test_an_unknown_model_is_404_model_not_found_in_each_protocol(server):
    native = httpx.post(f"{server.url}/v1/infer", json={"inputs": "a", "model": "nope"})
    assert native.status_code == 404
    assert native.json()["error_type"] == "model_not_found"
    assert "'clf'" in native.json()["error"]  # the message names what is served
    openai = httpx.post(f"{server.url}/v1/embeddings", json={"input": "a", "model": "nope"})
    assert openai.status_code == 404
    assert openai.json()["error"]["code"] == "model_not_found"
    assert openai.json()["error"]["param"] == "model"
    for request in (
        httpx.post(f"{server.url}/v2/models/nope/infer", json={"inputs": []}),
        httpx.get(f"{server.url}/v2/models/nope"),
        httpx.get(f"{server.url}/v2/models/nope/ready"),
    ):
        assert request.status_code == 404
        assert set(request.json()) == {"error"} and "nope" in request.json()["error"]
    # Each model answers by name in every protocol.
    v2 = httpx.get(f"{server.url}/v2/models/clf").json()
    assert v2["name"] == "clf" and v2["parameters"]["task"] == "classify"
    embeddings = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": "a", "model": BUNDLED_MODEL}
    )
    assert embeddings.status_code == 200
    wrong = httpx.post(f"{server.url}/v1/embeddings", json={"input": "a", "model": "rr"})
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (400, "wrong_task")


def test_models_lists_every_model_default_first(server):
    models = httpx.get(f"{server.url}/v1/models").json()["models"]
    assert [(m["name"], m["task"]) for m in models] == [
        (BUNDLED_MODEL, "embed"), ("clf", "classify"), ("rr", "rerank"),
    ]  # fmt: skip
    assert models[0]["output_dim"] == 384


MEMORY_LIMIT = 768 * 2**20


def test_two_models_share_one_memory_limit_under_a_burst(tmp_path):
    """Two copies of the bundled model under one address-space limit; a burst of long inputs
    to both at once: each batch is sized against the memory left at that moment."""
    with run_server(
        tmp_path, "--model", f"a={BUNDLED_MODEL}", "--model", f"b={BUNDLED_MODEL}",
        "--max-batch-size", "128", "--max-batch-tokens", "40000", "--max-wait-ms", "100",
        "--memory-limit", str(MEMORY_LIMIT),
    ) as server:  # fmt: skip
        # Each model's own warm-up proved a ceiling for its batches before the first request.
        ready = httpx.get(f"{server.url}/metrics").text
        ceilings = {m: metric(ready, "batchfit_batch_ceiling_bytes", f'model="{m}"')
                    for m in ("a", "b")}  # fmt: skip
        assert all(0 < c < MEMORY_LIMIT for c in ceilings.values()), ceilings
        assert all(f"warming up model {m}" in server.log() for m in ("a", "b"))
        rng = random.Random(3)
        burst = [
            (model, [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(4)])
            for model in ("a", "b") for _ in range(16)
        ]  # fmt: skip
        rng.shuffle(burst)

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                return await asyncio.gather(*(
                    client.post("/v1/infer", json={"inputs": inputs, "model": model,
                                                   "timeout_s": 300})
                    for model, inputs in burst
                ))  # fmt: skip

        responses = asyncio.run(main())
        assert [r.status_code for r in responses] == [200] * len(responses), [
            r.text for r in responses if r.status_code != 200
        ]
        vectors = np.asarray([v for r in responses for v in r.json()["outputs"]])
        reference = reference_embeddings([t for _, inputs in burst for t in inputs])
        assert min(cosine(a, b) for a, b in zip(vectors, reference, strict=True)) >= 0.9999
        # One more batch: its dispatch reads VmHWM, folding in the burst's last batch.
        after = httpx.post(f"{server.url}/v1/infer", json={"inputs": "after", "model": "b"})
        assert after.status_code == 200
        scrape = httpx.get(f"{server.url}/metrics").text
        for model in ("a", "b"):
            # Not one OOM, as with one model: each model's batches were planned by a memory
            # model its own warm-up calibrated, not split after the fact.
            for outcome in ("split", "failed"):
                labels = f'model="{model}",outcome="{outcome}"'
                assert metric(scrape, "batchfit_oom_events_total", labels) == 0, labels
            assert metric(scrape, "batchfit_batch_size_count", f'model="{model}"') > 0
        # The kernel's high-water mark of resident memory since start (VmHWM): both models'
        # loads, warm-ups and the whole burst. 1% of slack, as for one model: VmHWM also
        # counts memory outside any batch (thread stacks, the allocator's arenas).
        peak = metric(scrape, "batchfit_host_resident_peak_bytes")
        assert 0 < peak <= MEMORY_LIMIT * 1.01, peak
        assert httpx.get(f"{server.url}/health/ready").status_code == 200
