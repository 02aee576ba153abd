"""``/v2/embed``, ``/tokenize`` and ``/detokenize`` at their edges, over a scripted embedder:
each error in the route's own shape (Cohere's on ``/v2/embed``), 503 ``draining`` with
``Retry-After`` once the replica drains, 415 and ``invalid_json``, the deadline header, and
Cohere's priority reaching the queue."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_app import assert_error, running
from tests.test_protocol_routes import VectorModel

EMBED = "/v2/embed"
BODIES = {
    EMBED: {"texts": ["a b"], "input_type": "search_query"},
    "/tokenize": {"inputs": "a b"},
    "/detokenize": {"ids": [1, 2]},
}


def assert_cohere_error(response, status, error_type):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"id", "message", "error_type"}
    assert body["error_type"] == error_type and body["message"]
    assert body["id"] == response.headers["x-request-id"]
    return body


def assert_route_error(path, response, status, error_type):
    if path == EMBED:
        return assert_cohere_error(response, status, error_type)
    return assert_error(response, status, error_type)


async def test_the_scripted_embedder_answers_v2_embed(registry):
    async with running(VectorModel(), registry) as client:
        response = await client.post(EMBED, json={**BODIES[EMBED], "embedding_types": ["float"]})
    assert response.status_code == 200, response.text
    assert response.json()["embeddings"] == {"float": [[2.0, 3.0, 1.0]]}
    assert response.json()["texts"] == ["a b"]


@pytest.mark.parametrize("path", list(BODIES))
async def test_draining_is_503_in_the_routes_shape(registry, path):
    async with running(VectorModel(), registry) as client:
        client._transport.app.state.runtime.begin_drain()
        response = await client.post(path, json=BODIES[path])
    assert_route_error(path, response, 503, "draining")
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("content", [b"", b"{", b"x"], ids=["empty", "cut", "text"])
@pytest.mark.parametrize("path", list(BODIES))
async def test_unparsable_bodies_and_other_media_types(registry, path, content):
    async with running(VectorModel(), registry) as client:
        bad = await client.post(path, content=content, headers={"content-type": "application/json"})
        text = await client.post(path, content=b"{}", headers={"content-type": "text/plain"})
    assert_route_error(path, bad, 400, "invalid_json")
    assert_route_error(path, text, 415, "unsupported_media_type")


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_a_model_without_a_tokenizer(registry, path):
    async with running(VectorModel(), registry) as client:
        response = await client.post(path, json=BODIES[path])
    assert_error(response, 400, "no_tokenizer")


async def test_v2_embed_refusals(registry):
    async with running(VectorModel(), registry) as client:
        cases = {
            "both": await client.post(EMBED, json={"texts": ["a"], "inputs": []}),
            "neither": await client.post(EMBED, json={"input_type": "search_query"}),
            "header": await client.post(EMBED, json=BODIES[EMBED], headers={"X-Timeout-S": "-1"}),
            "unknown": await client.post(EMBED, json={**BODIES[EMBED], "typo": 1}),
            "priority": await client.post(EMBED, json={**BODIES[EMBED], "priority": -1}),
        }
    for response in cases.values():
        assert_cohere_error(response, 400, "invalid_request")


async def test_the_deadline_header_and_cohere_priority_reach_the_queue(registry):
    model = VectorModel()
    async with running(model, registry) as client:
        runtime = client._transport.app.state.runtime
        seen = []
        infer = runtime.infer

        async def spy(inputs, **kwargs):
            seen.append((kwargs["timeout_s"], kwargs["priority"]))
            return await infer(inputs, **kwargs)

        runtime.infer = spy
        headers = {"X-Timeout-S": "7"}
        answers = await asyncio.gather(
            client.post(EMBED, json={**BODIES[EMBED], "priority": 3}, headers=headers),
            client.post(EMBED, json={**BODIES[EMBED], "priority": 50}),
        )
    assert [a.status_code for a in answers] == [200, 200]
    assert sorted(seen) == sorted([(7.0, -3), (runtime.config.default_timeout_s, -10)])
