"""With ``--api-workers 2``, the compact outputs, Cohere's ``/v2/embed`` and the token routes
answer from the API processes as from one: the bundled model against transformers (its
tokenizer, its forward with mean pooling), sentence-transformers' ``quantize_embeddings`` and
torch's casts."""

from __future__ import annotations

import base64

import cohere
import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import quantize_embeddings
from transformers import AutoTokenizer

from models.loading import resolve_model_path
from models.spec import BUNDLED_MODEL
from tests.reference import cosine, reference_embeddings
from tests.servers import run_server

pytestmark = pytest.mark.integration

KEY = "compact-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["The cat sits on the mat.", "Der schnelle braune Fuchs.", "東京は日本の首都です。 🚀"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compact-workers")
    keys = folder / "keys"
    keys.write_text(f"{KEY}\n")
    with run_server(
        folder, "--model", BUNDLED_MODEL, "--api-workers", "2", "--api-key-file", str(keys)
    ) as live:
        yield live


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def test_tokenize_and_detokenize(server):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(BUNDLED_MODEL))
    for _ in range(4):  # both API processes answer (connections spread over them)
        answer = post(server, "/tokenize", {"inputs": TEXTS, "return_offsets": True}).json()
        expected = tokenizer(TEXTS, return_offsets_mapping=True)
        assert answer["tokens"] == expected["input_ids"]
        assert answer["offsets"] == [[list(s) for s in row] for row in expected["offset_mapping"]]
        texts = post(server, "/detokenize", {"ids": answer["tokens"]}).json()["texts"]
        assert texts == [tokenizer.decode(ids) for ids in expected["input_ids"]]


def test_cohere_client_and_compact_outputs(server):
    with httpx.Client(timeout=60) as http:
        client = cohere.ClientV2(base_url=server.url, api_key=KEY, httpx_client=http)
        response = client.embed(
            model=BUNDLED_MODEL, texts=TEXTS, input_type="search_document",
            embedding_types=["float", "ubinary", "binary"],
        )  # fmt: skip
    floats = np.asarray(response.embeddings.float_, dtype=np.float32)
    for got, expected in zip(floats, reference_embeddings(TEXTS), strict=True):
        assert cosine(got, expected) >= 0.9999
    assert response.embeddings.ubinary == quantize_embeddings(floats, "ubinary").tolist()
    assert response.embeddings.binary == quantize_embeddings(floats, "binary").tolist()
    body = {"model": BUNDLED_MODEL, "input": TEXTS, "encoding_format": "base64",
            "embed_dtype": "bfloat16"}  # fmt: skip
    data = post(server, "/v1/embeddings", body).json()["data"]
    cast = torch.from_numpy(floats).to(torch.bfloat16).view(torch.int16).numpy()
    assert [base64.b64decode(item["embedding"]) for item in data] == [
        row.astype("<i2").tobytes() for row in cast
    ]
    infer = post(server, "/v1/infer", {"inputs": TEXTS, "embedding_types": "int8"}).json()
    ranges = np.vstack([-np.ones(floats.shape[1]), np.ones(floats.shape[1])])
    assert infer["outputs"] == quantize_embeddings(floats, "int8", ranges=ranges).tolist()
