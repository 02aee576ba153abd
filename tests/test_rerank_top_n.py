"""``top_n`` on POST /v1/rerank is a limit, as Cohere's and Jina's rerank APIs read it: more than
the documents returns them all (LangChain's rerankers send top_n=3 whatever the number of
candidates); below 1 is refused. A tiny real cross-encoder on real uvicorn."""

import httpx
import pytest

from models import ModelSpec, load_model
from models.testing import save_tiny_model
from tests.inprocess import serve_in_thread

QUERY = "what do cats eat"
DOCUMENTS = ["Cats eat fish.", "The market fell.", "Dogs chase cats."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("rr"), task="rerank", seed=3)
    with serve_in_thread(load_model(ModelSpec(model=str(folder), device="cpu"))) as live:
        yield live


def rerank(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/rerank", json={"query": QUERY, **body}, timeout=30)


@pytest.fixture(scope="module")
def ranked(server):
    """Every document's index, best first, as the answer without top_n orders them."""
    response = rerank(server, documents=DOCUMENTS)
    assert response.status_code == 200, response.text
    return [result["index"] for result in response.json()["results"]]


@pytest.mark.parametrize(
    ("num_documents", "top_n", "num_results"),
    [
        (3, None, 3),
        (3, 1, 1),
        (3, 2, 2),
        (3, 3, 3),
        (3, 4, 3),  # LangChain's default of 3 with fewer candidates, and beyond
        (2, 3, 2),
        (1, 3, 1),
        (3, 10**9, 3),
    ],
)
def test_top_n_keeps_at_most_the_best(server, num_documents, top_n, num_results):
    documents = DOCUMENTS[:num_documents]
    body = {"documents": documents, "return_documents": True}
    if top_n is not None:
        body["top_n"] = top_n
    response = rerank(server, **body)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == num_results
    scores = [result["relevance_score"] for result in results]
    assert scores == sorted(scores, reverse=True)
    full = rerank(server, documents=documents).json()["results"]
    assert [r["index"] for r in results] == [r["index"] for r in full][:num_results]
    assert all(r["document"]["text"] == documents[r["index"]] for r in results)


def test_a_limit_past_the_documents_answers_as_none(server, ranked):
    limited = rerank(server, documents=DOCUMENTS, top_n=len(DOCUMENTS) + 1)
    assert limited.status_code == 200, limited.text
    assert [result["index"] for result in limited.json()["results"]] == ranked


@pytest.mark.parametrize("top_n", [0, -1, -(10**9)])
def test_top_n_below_one_is_refused(server, top_n):
    response = rerank(server, documents=DOCUMENTS, top_n=top_n)
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error_type"] == "invalid_top_n"
    assert f"got {top_n}" in error["error"]
