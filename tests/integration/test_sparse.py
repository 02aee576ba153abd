"""A sparse (SPLADE) embedder served by a real replica (uvicorn on a loopback port, with
and without API processes in front of its engine), beside a dense embedder: its vectors on
``/embed_sparse``, ``/v1/infer`` and v2 infer against sentence-transformers'
``SparseEncoder.encode`` reading the same folder, and each route's errors in its own shape."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from models.testing import save_tiny_model
from tests.servers import run_server
from tests.sparse_models import TEXTS, assert_matches, reference_vectors, save_sparse_encoder

pytestmark = pytest.mark.integration

KEY = "sparse-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse-models")
    return {
        "splade": save_sparse_encoder(root / "splade"),
        "dense": save_tiny_model(root / "dense"),
    }


@pytest.fixture(scope="module")
def expected(folders):
    return reference_vectors(folders["splade"], TEXTS)


# The dense model first: the default model, which /embed_sparse passes over for the first
# sparse one.
@pytest.fixture(scope="module", params=["one-process", "api-workers"])
def client(request, tmp_path_factory, folders):
    workers = ("--api-workers", "2") if request.param == "api-workers" else ()
    flags = ("--model", f"dense={folders['dense']}", "--model", f"splade={folders['splade']}")
    with (
        run_server(tmp_path_factory.mktemp("sparse"), *flags, "--api-key", KEY, *workers) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client,
    ):
        yield client


def test_embed_sparse_equals_the_sparse_encoder(client, expected):
    answer = client.post("/embed_sparse", json={"inputs": TEXTS})
    assert answer.status_code == 200, answer.text
    vectors = answer.json()
    assert len(vectors) == len(TEXTS)
    for vector, row in zip(vectors, expected, strict=True):
        assert all(set(entry) == {"index", "value"} for entry in vector)
        assert_matches([e["index"] for e in vector], [e["value"] for e in vector], row)
    alone = client.post("/embed_sparse", json={"inputs": TEXTS[1], "model": "splade"})
    assert alone.status_code == 200, alone.text
    (vector,) = alone.json()
    assert_matches([e["index"] for e in vector], [e["value"] for e in vector], expected[1])


def test_truncation_and_prompts_as_the_reference_reads_them(client, folders):
    long_text = TEXTS[-1]
    left = client.post(
        "/embed_sparse", json={"inputs": [long_text], "truncation_direction": "Left"}
    )
    assert left.status_code == 200, left.text
    from sentence_transformers import SparseEncoder

    reference = SparseEncoder(str(folders["splade"]), device="cpu")
    reference.tokenizer.truncation_side = "left"
    row = reference.encode([long_text], convert_to_tensor=True).to_dense().numpy()[0]
    (vector,) = left.json()
    assert_matches([e["index"] for e in vector], [e["value"] for e in vector], row)
    too_long = client.post("/embed_sparse", json={"inputs": long_text, "truncate": False})
    assert too_long.status_code == 413, too_long.text
    assert too_long.json()["error_type"] == "input_too_long"
    # The folder's own prompts, as sentence-transformers saves a SparseEncoder's: "" each.
    query = client.post("/embed_sparse", json={"inputs": TEXTS[1], "prompt_name": "query"})
    assert query.status_code == 200, query.text
    unknown = client.post("/embed_sparse", json={"inputs": TEXTS[1], "prompt_name": "nope"})
    assert unknown.status_code == 400
    assert unknown.json()["error_type"] == "unknown_prompt"


def test_v1_infer_answers_indices_and_values(client, expected):
    answer = client.post("/v1/infer", json={"inputs": TEXTS, "model": "splade"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == "splade" and body["usage"]["input_tokens"] > 0
    for output, row in zip(body["outputs"], expected, strict=True):
        assert set(output) == {"indices", "values"}
        assert_matches(output["indices"], output["values"], row)


def v2_body(texts, **parameters):
    return {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}],
        **({"parameters": parameters} if parameters else {}),
    }


def test_v2_infer_answers_the_vectors_as_csr_tensors(client, expected):
    metadata = client.get("/v2/models/splade").json()
    assert [(o["name"], o["datatype"]) for o in metadata["outputs"]] == [
        ("indices", "INT64"), ("values", "FP32"), ("offsets", "INT64"),
    ]  # fmt: skip
    answer = client.post("/v2/models/splade/infer", json=v2_body(TEXTS))
    assert answer.status_code == 200, answer.text
    tensors = {t["name"]: t for t in answer.json()["outputs"]}
    offsets = tensors["offsets"]["data"]
    assert tensors["offsets"]["shape"] == [len(TEXTS) + 1] and offsets[0] == 0
    assert tensors["indices"]["shape"] == tensors["values"]["shape"] == [offsets[-1]]
    for i, row in enumerate(expected):
        start, end = offsets[i], offsets[i + 1]
        assert_matches(
            tensors["indices"]["data"][start:end], tensors["values"]["data"][start:end], row
        )
    # Triton's binary tensor data: int64 and float32 little-endian, in the listed order.
    binary = client.post(
        "/v2/models/splade/infer", json=v2_body(TEXTS[:2], binary_data_output=True)
    )
    assert binary.status_code == 200, binary.text
    split = int(binary.headers["inference-header-content-length"])
    header = json.loads(binary.content[:split])
    raw, arrays = binary.content[split:], {}
    for tensor, dtype in zip(header["outputs"], ("<i8", "<f4", "<i8"), strict=True):
        size = tensor["parameters"]["binary_data_size"]
        arrays[tensor["name"]] = np.frombuffer(raw[:size], dtype=dtype)
        raw = raw[size:]
    offsets = arrays["offsets"]
    for i, row in enumerate(expected[:2]):
        start, end = offsets[i], offsets[i + 1]
        assert_matches(arrays["indices"][start:end], arrays["values"][start:end], row)


def test_a_sparse_route_refuses_a_dense_model_and_the_dense_routes_a_sparse_one(client):
    dense = client.post("/embed_sparse", json={"inputs": "hi", "model": "dense"})
    assert dense.status_code == 400, dense.text
    body = dense.json()
    assert body["error_type"] == "wrong_task" and "/embed_sparse" in body["error"]
    assert set(body) == {"error", "error_type", "request_id"}
    openai = client.post("/v1/embeddings", json={"input": "hi", "model": "splade"})
    assert openai.status_code == 400, openai.text
    error = openai.json()["error"]
    assert error["code"] == "wrong_task" and "/embed_sparse" in error["message"]
    rerank = client.post("/v1/rerank", json={"query": "q", "documents": ["d"], "model": "splade"})
    assert rerank.status_code == 400 and rerank.json()["error_type"] == "wrong_task"
    cut = client.post("/v1/infer", json={"inputs": "hi", "model": "splade", "dimensions": 8})
    assert cut.status_code == 400 and cut.json()["error_type"] == "unsupported_parameter"
    # The dense model still answers its own routes.
    assert client.post("/v1/infer", json={"inputs": "hi", "model": "dense"}).status_code == 200


def test_embed_sparse_errors_in_its_own_shape(client):
    cases = [
        ({"inputs": []}, 400, "empty_input"),
        ({"inputs": ["x", ""]}, 400, "empty_input"),
        ({"input": "x"}, 422, "invalid_request"),
        ({"inputs": "x", "truncate": "yes"}, 422, "invalid_request"),
        ({"inputs": "x", "truncation_direction": "up"}, 422, "invalid_request"),
        ({"inputs": "x", "priority": 11}, 422, "invalid_request"),
        ({"inputs": "x", "model": "nope"}, 404, "model_not_found"),
    ]
    for body, status, error_type in cases:
        answer = client.post("/embed_sparse", json=body)
        assert answer.status_code == status, (body, answer.text)
        assert answer.json()["error_type"] == error_type, (body, answer.text)
        assert answer.json()["request_id"] == answer.headers["x-request-id"]
    header = client.post("/embed_sparse", json={"inputs": "x"}, headers={"X-Timeout-S": "0"})
    assert header.status_code == 422, header.text
    keyless = httpx.post(f"{client.base_url}/embed_sparse", json={"inputs": "x"})
    assert keyless.status_code == 401 and keyless.json()["error_type"] == "unauthorized"
    wrong_method = client.get("/embed_sparse")
    assert wrong_method.status_code == 405
