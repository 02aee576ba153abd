"""Cohere's ``POST /v2/embed`` driven by the unmodified ``cohere`` client against real uvicorn,
and the ``query`` and ``document`` prompt names on a model without such prompts. References:
sentence-transformers reading the same folders (``encode_query``, ``encode_document``,
``encode``) and its ``quantize_embeddings``."""

from __future__ import annotations

import base64
import json

import cohere
import httpx
import numpy as np
import pytest
from cohere.core.api_error import ApiError as CohereApiError
from sentence_transformers import SentenceTransformer, quantize_embeddings

from models import ModelSpec, load_model
from tests.families import MAX_TOKENS, TEXTS, build_bert_cls, build_bert_prompts
from tests.inprocess import serve_in_thread

KEY = "cohere-test-key"
SHORT = TEXTS[:13]  # within the tiny models' 128 tokens
LONG = TEXTS[13:]  # past them
ATOL = 2e-5


def without_empty_prompts(folder):
    """The folder as sentence-transformers before 6 saved it: sentence-transformers 6 writes
    the ``query: ""`` and ``document: ""`` it gains into the folder, older folders lack them."""
    path = folder / "config_sentence_transformers.json"
    config = json.loads(path.read_text())
    config["prompts"] = {name: text for name, text in config["prompts"].items() if text}
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cohere")
    build_bert_prompts(root / "prompts")  # query and passage prompts, query by default
    build_bert_cls(root / "plain")  # no prompts
    for folder in (root / "prompts", root / "plain"):
        without_empty_prompts(folder)
    return {"prompts": root / "prompts", "plain": root / "plain"}


@pytest.fixture(scope="module")
def references(folders):
    return {name: SentenceTransformer(str(f), device="cpu") for name, f in folders.items()}


@pytest.fixture(scope="module")
def server(folders):
    models = {
        name: load_model(ModelSpec(model=str(folder), device="cpu"))
        for name, folder in folders.items()
    }
    with serve_in_thread(None, models=models, api_key=KEY) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(timeout=60) as http:  # closed at the end, so no socket is left open
        yield cohere.ClientV2(base_url=server.url, api_key=KEY, httpx_client=http)


def post(server, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_every_type_at_once_against_sentence_transformers(client, references):
    response = client.embed(
        model="prompts", texts=SHORT, input_type="search_query",
        embedding_types=["float", "binary", "ubinary", "int8", "uint8", "base64"],
    )  # fmt: skip
    floats = np.asarray(response.embeddings.float_, dtype=np.float32)
    np.testing.assert_allclose(floats, references["prompts"].encode_query(SHORT), atol=ATOL)
    for kind in ("binary", "ubinary"):
        expected = quantize_embeddings(floats, precision=kind)
        assert getattr(response.embeddings, kind) == expected.tolist(), kind
    ranges = np.vstack([-np.ones(floats.shape[1]), np.ones(floats.shape[1])])
    for kind in ("int8", "uint8"):
        expected = quantize_embeddings(floats, precision=kind, ranges=ranges)
        assert getattr(response.embeddings, kind) == expected.tolist(), kind
    decoded = [np.frombuffer(base64.b64decode(s), "<f4") for s in response.embeddings.base64]
    assert [row.tobytes() for row in decoded] == [row.tobytes() for row in floats]
    assert response.texts == SHORT
    assert response.id
    assert response.meta.billed_units.input_tokens > len(SHORT)


@pytest.mark.parametrize("model", ["prompts", "plain"])
def test_input_types_map_to_the_prompts_as_sentence_transformers_reads_them(
    client, references, model
):
    reference = references[model]
    assert reference.prompts.get("document") == ""  # sentence-transformers 6 gains it
    query = client.embed(model=model, texts=SHORT, input_type="search_query")
    document = client.embed(model=model, texts=SHORT, input_type="search_document")
    np.testing.assert_allclose(query.embeddings.float_, reference.encode_query(SHORT), atol=ATOL)
    np.testing.assert_allclose(
        document.embeddings.float_, reference.encode_document(SHORT), atol=ATOL
    )
    for input_type in ("classification", "clustering"):  # neither model has such a prompt
        other = client.embed(model=model, texts=SHORT, input_type=input_type)
        np.testing.assert_allclose(
            other.embeddings.float_, reference.encode(SHORT, prompt=""), atol=ATOL
        )
    if model == "prompts":  # the query prompt was put in front, the document one was not
        assert not np.allclose(query.embeddings.float_, document.embeddings.float_, atol=1e-3)


@pytest.mark.parametrize("prompt_name", ["query", "document"])
@pytest.mark.parametrize("route", ["/v1/infer", "/v1/embeddings"])
def test_query_and_document_on_a_model_without_them(server, references, prompt_name, route):
    card = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert {m["name"]: m["prompts"] for m in card.json()["models"]}["plain"] == {}
    expected = references["plain"].encode(SHORT, prompt_name=prompt_name)
    if route == "/v1/infer":
        response = post(server, route, {"model": "plain", "inputs": SHORT,
                                        "prompt_name": prompt_name})  # fmt: skip
        got = response.json()["outputs"] if response.status_code == 200 else None
    else:
        response = post(server, route, {"model": "plain", "input": SHORT,
                                        "prompt_name": prompt_name})  # fmt: skip
        got = [item["embedding"] for item in response.json().get("data", [])]
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(got, expected, atol=ATOL)
    unknown = post(server, "/v1/infer", {"model": "plain", "inputs": SHORT, "prompt_name": "x"})
    assert (unknown.status_code, unknown.json()["error_type"]) == (400, "unknown_prompt")


def test_inputs_of_text_content_are_the_texts(client):
    inputs = [{"content": [{"type": "text", "text": text}]} for text in SHORT[:3]]
    split = [{"content": [{"type": "text", "text": "The cat "},
                          {"type": "text", "text": "sits on the mat."}]}]  # fmt: skip
    by_inputs = client.embed(model="plain", inputs=inputs + split, input_type="search_query")
    by_texts = client.embed(model="plain", texts=[*SHORT[:3], "The cat sits on the mat."],
                            input_type="search_query")  # fmt: skip
    assert by_inputs.embeddings.float_ == by_texts.embeddings.float_


def test_output_dimension_is_cut_and_renormalised(client, references):
    response = client.embed(
        model="plain", texts=SHORT, input_type="search_query", output_dimension=16,
        embedding_types=["float", "ubinary"],
    )  # fmt: skip
    full = references["plain"].encode(SHORT)[:, :16]
    expected = full / np.linalg.norm(full, axis=1, keepdims=True)
    floats = np.asarray(response.embeddings.float_, dtype=np.float32)
    np.testing.assert_allclose(floats, expected, atol=ATOL)
    assert response.embeddings.ubinary == quantize_embeddings(floats, "ubinary").tolist()


def test_truncate_start_end_and_none(client, folders):
    for truncate, side in (("END", "right"), ("START", "left")):
        reference = SentenceTransformer(str(folders["plain"]), device="cpu")
        reference.tokenizer.truncation_side = side
        response = client.embed(model="plain", texts=LONG, input_type="clustering",
                                truncate=truncate)  # fmt: skip
        np.testing.assert_allclose(response.embeddings.float_, reference.encode(LONG), atol=ATOL)
    with pytest.raises(CohereApiError) as info:
        client.embed(model="plain", texts=LONG, input_type="search_query", truncate="NONE")
    assert info.value.status_code == 413
    assert info.value.body["error_type"] == "input_too_long"
    assert f"maximum of {MAX_TOKENS}" in info.value.body["message"]


@pytest.mark.parametrize(
    ("kwargs", "status", "error_type"),
    [
        ({"model": "nope"}, 404, "model_not_found"),
        ({"images": ["data:image/png;base64,AAAA"], "texts": None}, 400, "unsupported_input"),
        ({"input_type": "image"}, 400, "unsupported_input"),
        ({"output_dimension": 33}, 400, "invalid_dimensions"),
        ({"texts": []}, 400, "empty_input"),
        ({"embedding_types": ["int4"]}, 400, "invalid_request"),
    ],
)
def test_errors_in_cohere_shape(client, kwargs, status, error_type):
    arguments = {"model": "plain", "texts": SHORT[:2], "input_type": "search_query", **kwargs}
    arguments = {key: value for key, value in arguments.items() if value is not None}
    with pytest.raises(CohereApiError) as info:
        client.embed(**arguments)
    assert info.value.status_code == status
    assert info.value.body["error_type"] == error_type
    assert info.value.body["message"] and info.value.body["id"]


def test_a_wrong_key_is_a_cohere_401(server):
    with httpx.Client(timeout=30) as http:
        wrong = cohere.ClientV2(base_url=server.url, api_key="wrong", httpx_client=http)
        with pytest.raises(cohere.UnauthorizedError) as info:
            wrong.embed(model="plain", texts=["a"], input_type="search_query")
    assert info.value.body["error_type"] == "unauthorized"
