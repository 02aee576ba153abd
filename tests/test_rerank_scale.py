"""Rerank over many documents, on real uvicorn with a tiny random cross-encoder: up to
--max-rerank-documents per request (past --max-inputs-per-request the documents enter the
queue in pieces), scored as sentence-transformers' CrossEncoder scores them; Jina's shape on
/v1/rerank and Cohere's on /v2/rerank; max_tokens_per_doc as transformers' truncation."""

import math
import random

import httpx
import pytest
import torch
from sentence_transformers import CrossEncoder
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from models import ModelSpec, load_model
from models.testing import save_tiny_model
from tests.inprocess import serve_in_thread

QUERY = "what do cats eat in the winter"
WORDS = [
    "cats",
    "fish",
    "market",
    "winter",
    "dogs",
    "bread",
    "river",
    "mountain",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "sleeping",
    "garden",
    "coffee",
    "morning",
    "train",
    "station",
    "music",
    "piano",
    "reading",
    "library",
    "window",
]


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct texts of varied length."""
    rng = random.Random(seed)
    return [
        f"{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # Wide weights: scores spread over (0, 1), not all within 1e-4 of 0.5.
    return save_tiny_model(
        tmp_path_factory.mktemp("rr"), task="rerank", seed=5, initializer_range=0.3
    )


@pytest.fixture(scope="module")
def server(folder):
    # The output cache off, so that a request sent again is computed again.
    with serve_in_thread(
        load_model(ModelSpec(model=str(folder), device="cpu")), cache_bytes=0
    ) as live:
        yield live


@pytest.fixture(scope="module")
def small_queue(folder):
    """A queue of 16 items and requests of at most 8 inputs: a rerank request of more
    documents than the whole queue holds."""
    with serve_in_thread(
        load_model(ModelSpec(model=str(folder), device="cpu")),
        max_queue_items=16, max_inputs_per_request=8, max_rerank_documents=300,
    ) as live:  # fmt: skip
        yield live


def scores_by_index(response: httpx.Response, count: int) -> list[float]:
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == count
    assert sorted(r["index"] for r in results) == list(range(count))
    found = [0.0] * count
    for result in results:
        found[result["index"]] = result["relevance_score"]
    return found


def reference(folder, texts: list[str]) -> list[float]:
    model = CrossEncoder(str(folder), device="cpu")
    return [float(s) for s in model.predict([(QUERY, text) for text in texts], batch_size=256)]


def test_five_thousand_documents_in_one_call_equal_them_sent_in_pieces(server, folder):
    texts = documents(5000)
    whole = httpx.post(
        f"{server.url}/v1/rerank", json={"query": QUERY, "documents": texts}, timeout=300
    )
    one_call = scores_by_index(whole, len(texts))
    assert whole.json()["results"][0]["relevance_score"] == max(one_call)
    pieces = []
    for start in range(0, len(texts), 250):
        part = texts[start : start + 250]
        answer = httpx.post(
            f"{server.url}/v1/rerank", json={"query": QUERY, "documents": part}, timeout=60
        )
        pieces.extend(scores_by_index(answer, len(part)))
    assert one_call == pytest.approx(pieces, abs=1e-6)
    assert one_call == pytest.approx(reference(folder, texts), abs=1e-5)


def test_more_documents_than_the_queue_holds_are_answered_in_pieces(small_queue, folder):
    runtime = small_queue.app.state.runtime
    queue = runtime.queue
    deepest = []
    put_many = queue.put_many

    def recording(pendings):
        put_many(pendings)
        deepest.append(len(queue))

    queue.put_many = recording
    try:
        texts = documents(300, seed=1)
        answer = httpx.post(
            f"{small_queue.url}/v2/rerank", json={"query": QUERY, "documents": texts}, timeout=60
        )
    finally:
        del queue.put_many
    assert scores_by_index(answer, 300) == pytest.approx(reference(folder, texts), abs=1e-5)
    assert len(deepest) >= 300 // 8
    assert max(deepest) <= 16  # never more than two pieces of it at once


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
def test_more_than_max_rerank_documents_is_413_in_the_routes_shape(small_queue, route):
    answer = httpx.post(
        f"{small_queue.url}{route}", json={"query": QUERY, "documents": documents(301)},
        timeout=30,
    )  # fmt: skip
    assert answer.status_code == 413, answer.text
    body = answer.json()
    assert body["error_type"] == "too_many_inputs"
    message = body["message"] if route == "/v2/rerank" else body["error"]
    assert "301 documents" in message and "--max-rerank-documents" in message


@pytest.fixture(scope="module")
def reference_model(folder):
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    module = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    return tokenizer, module


def transformers_pair(tokenizer, query: str, document: str, max_tokens: int, **options):
    """The pair as transformers encodes it with the document truncated to ``max_tokens`` of
    its own tokens (``only_second``, within the query's tokens and the special ones)."""
    query_ids = tokenizer(query, add_special_tokens=False)["input_ids"]
    length = len(query_ids) + max_tokens + tokenizer.num_special_tokens_to_add(pair=True)
    return tokenizer(query, document, truncation="only_second", max_length=length, **options)


LONG = [
    "The quick brown fox jumps over the lazy dog while the cats eat their fish by the river.",
    "Unbelievably, tokenization splits uncommonly long words into several word pieces.",
    "short one",
    "Cats, dogs & birds: 3 friends (really!) who share a garden; they eat bread at noon.",
]


@pytest.mark.parametrize("max_tokens", [1, 3, 7, 12])
def test_max_tokens_per_doc_cuts_as_transformers_truncates(folder, reference_model, max_tokens):
    tokenizer, _ = reference_model
    model = load_model(ModelSpec(model=str(folder), device="cpu"))
    items = model.prepare_pairs(QUERY, LONG, max_tokens_per_doc=max_tokens)
    for item, text in zip(items, LONG, strict=True):
        pair = transformers_pair(tokenizer, QUERY, text, max_tokens)
        assert list(item.data.ids) == pair["input_ids"]
        assert list(item.data.type_ids) == pair["token_type_ids"]


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
def test_max_tokens_per_doc_scores_as_transformers(server, reference_model, route):
    tokenizer, module = reference_model
    answer = httpx.post(
        f"{server.url}{route}",
        json={"query": QUERY, "documents": LONG, "max_tokens_per_doc": 5},
        timeout=30,
    )
    found = scores_by_index(answer, len(LONG))
    with torch.inference_mode():
        expected = [
            torch.sigmoid(
                module(**transformers_pair(tokenizer, QUERY, text, 5, return_tensors="pt")).logits
            ).item()
            for text in LONG
        ]
    assert found == pytest.approx(expected, abs=1e-5)
    uncut = scores_by_index(
        httpx.post(f"{server.url}{route}", json={"query": QUERY, "documents": LONG}, timeout=30),
        len(LONG),
    )
    assert uncut != pytest.approx(found, abs=1e-3)


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_per_doc_below_one_is_a_schema_error(server, route, max_tokens):
    answer = httpx.post(
        f"{server.url}{route}",
        json={"query": QUERY, "documents": LONG, "max_tokens_per_doc": max_tokens},
        timeout=30,
    )
    assert answer.status_code == (400 if route == "/v2/rerank" else 422), answer.text
    assert answer.json()["error_type"] == "invalid_request"


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
def test_the_timeout_header_sets_the_deadline(server, route):
    body = {"query": QUERY, "documents": documents(40)}
    late = httpx.post(
        f"{server.url}{route}", json=body, headers={"X-Timeout-S": "0.000001"}, timeout=30
    )
    assert late.status_code == 504, late.text
    assert late.json()["error_type"] == "deadline_exceeded"
    bad = httpx.post(f"{server.url}{route}", json=body, headers={"X-Timeout-S": "-1"}, timeout=30)
    assert bad.status_code == (400 if route == "/v2/rerank" else 422), bad.text
    assert bad.json()["error_type"] == "invalid_request"
    fine = httpx.post(f"{server.url}{route}", json=body, headers={"X-Timeout-S": "30"}, timeout=30)
    assert fine.status_code == 200, fine.text


@pytest.mark.parametrize(
    ("route", "priority", "status"),
    [("/v1/rerank", 11, 422), ("/v1/rerank", -10, 200), ("/v2/rerank", -1, 400),
     ("/v2/rerank", 10, 200), ("/v2/rerank", 11, 400)],
)  # fmt: skip
def test_priority_is_checked_as_each_api_defines_it(server, route, priority, status):
    body = {"query": QUERY, "documents": LONG, "priority": priority}
    answer = httpx.post(f"{server.url}{route}", json=body, timeout=30)
    assert answer.status_code == status, answer.text


@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
def test_raw_scores_are_the_logits_transformers_computes(server, reference_model, route):
    tokenizer, module = reference_model
    body = {"query": QUERY, "documents": LONG, "raw_scores": True, "return_documents": True}
    answer = httpx.post(f"{server.url}{route}", json=body, timeout=30)
    found = scores_by_index(answer, len(LONG))
    with torch.inference_mode():
        logits = [
            module(**tokenizer(QUERY, text, return_tensors="pt")).logits.item() for text in LONG
        ]
    assert found == pytest.approx(logits, abs=1e-5)
    assert any(not 0 < s < 1 for s in found)  # logits, not probabilities
    # Ranked as the scores rank them; without raw_scores, the same order of sigmoids.
    results = answer.json()["results"]
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -logits[i])
    plain = scores_by_index(
        httpx.post(f"{server.url}{route}", json={"query": QUERY, "documents": LONG}, timeout=30),
        len(LONG),
    )
    assert plain == pytest.approx([1 / (1 + math.exp(-x)) for x in logits], abs=1e-6)
