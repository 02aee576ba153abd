"""Compact outputs on ``/v1/embeddings`` and ``/v1/infer``: base64 bytes of float32, float16 or
bfloat16 (as torch casts), and binary, ubinary, int8 and uint8 exactly as
sentence-transformers' ``quantize_embeddings`` packs them. Tiny sentence-transformers folders
on real uvicorn; the float answer's vectors are what the references quantize."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer, quantize_embeddings

from models import ModelSpec, load_model
from server.encodings import quantize, to_dtype_bytes
from tests.families import TEXTS, build_bert_cls, build_bert_mean_raw
from tests.inprocess import serve_in_thread

UNIT_RANGES = np.vstack([-np.ones(32, np.float32), np.ones(32, np.float32)])
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def reference_bytes(vector: np.ndarray, dtype: str) -> bytes:
    """The vector cast by torch, its bytes little-endian (as vLLM writes embed_dtype)."""
    cast = torch.from_numpy(np.asarray(vector, np.float32)).to(TORCH_DTYPES[dtype])
    view = cast.view(torch.int16) if dtype == "bfloat16" else cast
    return view.numpy().astype(view.numpy().dtype.newbyteorder("<")).tobytes()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("compact")
    build_bert_cls(root / "unit")  # normalises
    build_bert_mean_raw(root / "raw")  # does not
    return root / "unit", root / "raw"


@pytest.fixture(scope="module")
def server(folders):
    unit, raw = folders
    models = {
        "unit": load_model(ModelSpec(model=str(unit), device="cpu")),
        "raw": load_model(ModelSpec(model=str(raw), device="cpu")),
    }
    with serve_in_thread(None, models=models) as live:
        yield live


@pytest.fixture(scope="module")
def floats(server):
    """Each model's float answer for TEXTS (compared with sentence-transformers below)."""
    found = {}
    for name in ("unit", "raw"):
        body = {"model": name, "inputs": TEXTS}
        response = httpx.post(f"{server.url}/v1/infer", json=body, timeout=60)
        assert response.status_code == 200, response.text
        found[name] = np.asarray(response.json()["outputs"], dtype=np.float32)
    return found


def test_the_float_answers_are_sentence_transformers(folders, floats):
    for folder, name in zip(folders, ("unit", "raw"), strict=True):
        expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
        np.testing.assert_allclose(floats[name], expected, atol=2e-5)


def embeddings(server, **body) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/embeddings", json={"model": "unit", "input": TEXTS, **body}, timeout=60
    )


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_base64_bytes_of_each_dtype(server, floats, dtype):
    response = embeddings(server, encoding_format="base64", embed_dtype=dtype)
    assert response.status_code == 200, response.text
    for row, item in zip(floats["unit"], response.json()["data"], strict=True):
        assert base64.b64decode(item["embedding"]) == reference_bytes(row, dtype)
    infer = httpx.post(
        f"{server.url}/v1/infer",
        json={"model": "unit", "inputs": TEXTS, "encoding_format": "base64", "embed_dtype": dtype},
        timeout=60,
    )
    assert infer.status_code == 200, infer.text
    assert infer.json()["outputs"] == [item["embedding"] for item in response.json()["data"]]


def test_base64_without_a_dtype_is_float32(server, floats):
    response = embeddings(server, encoding_format="base64")
    data = response.json()["data"]
    assert [base64.b64decode(item["embedding"]) for item in data] == [
        reference_bytes(row, "float32") for row in floats["unit"]
    ]


@pytest.mark.parametrize("kind", ["binary", "ubinary", "int8", "uint8"])
@pytest.mark.parametrize("route", ["/v1/embeddings", "/v1/infer"])
def test_quantized_as_quantize_embeddings(server, floats, kind, route):
    ranges = UNIT_RANGES if kind.endswith("int8") else None
    expected = quantize_embeddings(floats["unit"], precision=kind, ranges=ranges)
    if route == "/v1/embeddings":
        response = embeddings(server, embedding_types=[kind])
        got = [item["embedding"] for item in response.json()["data"]]
    else:
        body = {"model": "unit", "inputs": TEXTS, "embedding_types": kind}
        response = httpx.post(f"{server.url}{route}", json=body, timeout=60)
        got = response.json()["outputs"]
    assert response.status_code == 200, response.text
    assert got == expected.tolist()
    as_bytes = embeddings(server, embedding_types=kind, encoding_format="base64").json()["data"]
    assert [base64.b64decode(i["embedding"]) for i in as_bytes] == [r.tobytes() for r in expected]


def test_binary_of_a_model_that_does_not_normalise(server, floats):
    expected = quantize_embeddings(floats["raw"], precision="ubinary")
    response = embeddings(server, model="raw", embedding_types="ubinary")
    assert [item["embedding"] for item in response.json()["data"]] == expected.tolist()


@pytest.mark.parametrize(
    ("route", "body", "status", "error_type"),
    [
        ("/v1/embeddings", {"model": "raw", "embedding_types": "int8"}, 400,
         "unsupported_parameter"),
        ("/v1/embeddings", {"embed_dtype": "float16"}, 400, "invalid_request"),
        ("/v1/embeddings", {"embedding_types": ["binary", "int8"]}, 400, "invalid_request"),
        ("/v1/embeddings", {"embedding_types": "binary", "embed_dtype": "bfloat16",
                            "encoding_format": "base64"}, 400, "invalid_request"),
        ("/v1/embeddings", {"embedding_types": "int4"}, 400, "invalid_request"),
        ("/v1/infer", {"model": "raw", "embedding_types": "uint8"}, 400, "unsupported_parameter"),
        ("/v1/infer", {"embed_dtype": "bfloat16"}, 422, "invalid_request"),
    ],
)  # fmt: skip
def test_refused(server, route, body, status, error_type):
    if route == "/v1/embeddings":
        response = embeddings(server, **body)
        error = response.json()["error"]
        assert (response.status_code, error["code"]) == (status, error_type), response.text
    else:
        payload = {"model": "unit", "inputs": ["a"], **body}
        response = httpx.post(f"{server.url}{route}", json=payload, timeout=60)
        assert (response.status_code, response.json()["error_type"]) == (status, error_type)


# The encodings alone, on values that show rounding and packing: ties, signs, NaN-free edges.
EDGES = np.array(
    [
        [1.0, -1.0, 0.0, -0.0, 1.00390625, 1.01171875, 3.3895314e38, 1e-40, -2.5, 0.333333],
        [65504.0, 70000.0, -1e-8, 5.96e-8, 0.1, -0.1, 0.99999994, -0.99999994, 2.0, 1e-3],
    ],
    dtype=np.float32,
)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtype_bytes_match_torch_casts(dtype):
    rng = np.random.default_rng(0)
    rows = np.concatenate([EDGES, rng.standard_normal((50, 10)).astype(np.float32)])
    for row in rows:
        assert to_dtype_bytes(row[None], dtype)[0].tobytes() == reference_bytes(row, dtype)


@pytest.mark.parametrize("kind", ["binary", "ubinary", "int8", "uint8"])
@pytest.mark.parametrize("width", [8, 10, 32, 1])
def test_quantize_matches_sentence_transformers(kind, width):
    rng = np.random.default_rng(width)
    rows = np.clip(rng.standard_normal((20, width)).astype(np.float32) / 2, -1, 1)
    rows[0] = 0.0
    ranges = np.vstack([-np.ones(width), np.ones(width)]) if kind.endswith("int8") else None
    expected = quantize_embeddings(rows, precision=kind, ranges=ranges)
    got = quantize(rows, kind)
    assert got.dtype == expected.dtype
    assert got.tolist() == expected.tolist()
