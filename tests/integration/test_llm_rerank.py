"""An LLM reranker behind a real replica: a tiny random Qwen3ForCausalLM in a folder named as
Qwen3-Reranker's, served without a task (its name says it reranks), in one process and with
API processes in front of the engine. ``POST /v1/rerank`` equals the model card's scores
computed with transformers; what the model cannot do is refused in the route's error shape."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.families import (
    QUERY,
    TEXTS,
    build_qwen3_reranker,
    quiet,
    qwen3_reranker_inputs,
    qwen3_reranker_scores,
)
from tests.servers import run_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("llm-rerank") / "Qwen3-Reranker-tiny"
    with quiet():
        build_qwen3_reranker(out)
    return out


@pytest.fixture(scope="module")
def card_scores(folder):
    return qwen3_reranker_scores(folder, QUERY, TEXTS, batch_size=1)


@pytest.fixture(scope="module", params=["one process", "api workers"])
def client(request, tmp_path_factory, folder):
    workers = ("--api-workers", "2") if request.param == "api workers" else ()
    with (
        run_server(
            tmp_path_factory.mktemp("llm-rerank-server"), "--model", f"rr={folder}",
            "--max-batch-size", "8", *workers,
        ) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):  # fmt: skip
        yield client


def rerank(client, **body):
    response = client.post("/v1/rerank", json={"model": "rr", "query": QUERY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_scores_equal_the_model_cards_in_one_request_and_one_by_one(client, folder, card_scores):
    answer = rerank(client, documents=TEXTS)
    batched = np.zeros(len(TEXTS))
    for result in answer["results"]:
        batched[result["index"]] = result["relevance_score"]
    np.testing.assert_allclose(batched, card_scores, atol=1e-5)
    alone = [rerank(client, documents=[t])["results"][0]["relevance_score"] for t in TEXTS[:5]]
    np.testing.assert_allclose(alone, card_scores[:5], atol=1e-5)
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokens = sum(len(ids) for ids in qwen3_reranker_inputs(tokenizer, QUERY, TEXTS))
    assert answer["usage"]["input_tokens"] == tokens


def test_top_n_and_documents_follow_the_scores(client, card_scores):
    answer = rerank(client, documents=TEXTS, top_n=3, return_documents=True)
    best = np.argsort(-card_scores, kind="stable")[:3]
    assert [r["index"] for r in answer["results"]] == list(best)
    assert [r["document"]["text"] for r in answer["results"]] == [TEXTS[i] for i in best]


def test_the_model_card_says_what_it_is(client):
    cards = {card["name"]: card for card in client.get("/v1/models").json()["models"]}
    card = cards["rr"]
    assert (card["task"], card["activation"], card["architecture"]) == (
        "rerank", "sigmoid", "decoder",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "needle"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "truncation_direction": "left"},
         400, "unsupported_parameter", "truncation_direction"),
        ("/v1/infer", {"inputs": ["a"]}, 400, "wrong_task", "/v1/rerank"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, 400, "empty_input", "query"),
    ],
)  # fmt: skip
def test_what_it_cannot_do_is_refused_in_the_routes_shape(
    client, path, body, status, error_type, needle
):
    response = client.post(path, json={"model": "rr", **body})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["error_type"] == error_type and needle in error["error"]
    assert error["request_id"]
