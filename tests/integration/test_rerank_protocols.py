"""Both rerank shapes on one replica of ``--api-workers 2`` with an API key and a queue smaller
than the request: Jina's on /v1/rerank, Cohere's on /v2/rerank, and the unmodified ``cohere``
client's ``ClientV2.rerank``; scores against sentence-transformers' CrossEncoder."""

from __future__ import annotations

import json
import random

import cohere
import httpx
import pytest
from cohere.core.api_error import ApiError
from sentence_transformers import CrossEncoder

from models.testing import save_tiny_model
from tests.servers import run_server

pytestmark = pytest.mark.integration

KEY = "rerank-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUERY = "what do cats eat"
WORDS = ["cats", "fish", "market", "dogs", "bread", "river", "piano", "garden", "winter"]


def documents(count: int) -> list[str]:
    rng = random.Random(count)
    return [f"{i} " + " ".join(rng.choices(WORDS, k=rng.randint(2, 12))) for i in range(count)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("rr"), task="rerank", seed=7, initializer_range=0.3
    )


@pytest.fixture(scope="module")
def replica(tmp_path_factory, folder):
    flags = ("--model", str(folder), "--api-workers", "2", "--api-key", KEY,
             "--max-queue-items", "16", "--max-inputs-per-request", "8",
             "--max-rerank-documents", "120")  # fmt: skip
    with run_server(tmp_path_factory.mktemp("logs"), *flags) as server:
        yield server


def reference(folder, texts: list[str]) -> list[float]:
    model = CrossEncoder(str(folder), device="cpu")
    return [float(s) for s in model.predict([(QUERY, text) for text in texts])]


def test_jina_and_cohere_shapes_answer_the_same_ranking(replica, folder):
    texts = documents(100)
    expected = reference(folder, texts)
    best = sorted(range(len(texts)), key=lambda i: -expected[i])[:5]
    jina = httpx.post(
        f"{replica.url}/v1/rerank", headers=AUTH, timeout=60,
        json={"query": QUERY, "documents": texts, "top_n": 5, "return_documents": True},
    )  # fmt: skip
    assert jina.status_code == 200, jina.text
    body = jina.json()
    assert set(body) == {"model", "results", "usage", "request_id"}
    assert [r["index"] for r in body["results"]] == best
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [expected[i] for i in best], abs=1e-5
    )
    assert [r["document"]["text"] for r in body["results"]] == [texts[i] for i in best]
    # Cohere's documents may be objects; its answer has an id and meta, no model or usage.
    sent = [text if i % 2 else {"text": text} for i, text in enumerate(texts)]
    answer = httpx.post(
        f"{replica.url}/v2/rerank", headers=AUTH, timeout=60,
        json={"model": folder.name, "query": QUERY, "documents": sent, "top_n": 5},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"id", "results", "meta"}
    assert body["id"] == answer.headers["x-request-id"]
    assert body["meta"]["api_version"]["version"] == "2"
    assert body["meta"]["tokens"]["input_tokens"] == jina.json()["usage"]["input_tokens"]
    assert [r["index"] for r in body["results"]] == best
    assert all(set(r) == {"index", "relevance_score"} for r in body["results"])
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [expected[i] for i in best], abs=1e-5
    )


def test_the_cohere_client_reranks(replica, folder):
    texts = documents(120)
    expected = reference(folder, texts)
    # The replica serves the model under its folder's name.
    with httpx.Client(timeout=60) as http:
        client = cohere.ClientV2(api_key=KEY, base_url=replica.url, httpx_client=http)
        answer = client.rerank(model=folder.name, query=QUERY, documents=texts, top_n=3)
        with pytest.raises(ApiError) as refused:
            client.rerank(model=folder.name, query=QUERY, documents=documents(121))
        wrong = cohere.ClientV2(api_key="wrong", base_url=replica.url, httpx_client=http)
        with pytest.raises(ApiError) as unauthorised:
            wrong.rerank(model=folder.name, query=QUERY, documents=texts[:3])
    best = sorted(range(len(texts)), key=lambda i: -expected[i])[:3]
    assert [r.index for r in answer.results] == best
    assert [r.relevance_score for r in answer.results] == pytest.approx(
        [expected[i] for i in best], abs=1e-5
    )
    assert refused.value.status_code == 413
    assert refused.value.body["error_type"] == "too_many_inputs"
    assert unauthorised.value.status_code == 401


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({"query": QUERY, "documents": []}, 400, "empty_input"),
        ({"query": "", "documents": ["a"]}, 400, "empty_input"),
        ({"query": QUERY, "documents": ["a", ""]}, 400, "empty_input"),
        ({"query": QUERY, "documents": [{"title": "a"}]}, 400, "invalid_request"),
        ({"query": QUERY, "documents": ["a", "\ud800"]}, 400, "invalid_request"),
        ({"query": QUERY, "documents": ["a"], "top_n": 0}, 422, "invalid_top_n"),
        ({"query": QUERY, "documents": ["a"], "model": "nope"}, 404, "model_not_found"),
    ],
)
def test_cohere_errors_take_its_shape(replica, body, status, error_type):
    # As JSON escapes: a lone surrogate travels as "\ud800".
    answer = httpx.post(
        f"{replica.url}/v2/rerank", headers={**AUTH, "content-type": "application/json"},
        content=json.dumps(body), timeout=30,
    )  # fmt: skip
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert set(error) == {"id", "message", "error_type"}
    assert error["error_type"] == error_type
