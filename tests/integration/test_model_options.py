"""Real replicas started with --dtype, --quantize and a python: entry point."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as triton

from models import ModelSpec, load_model
from models.spec import BUNDLED_MODEL
from tests.integration.test_server import SENTENCES, cosine, reference  # noqa: F401 (fixture)
from tests.servers import run_server
from tests.test_model_options import MIN_COSINE

pytestmark = pytest.mark.integration


def openai_embeddings(server, model, texts):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        response = client.embeddings.create(input=texts, model=model)
    return np.asarray([d.embedding for d in response.data], dtype=np.float32)


def triton_embeddings(server, model, texts):
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=60)
    try:
        tensor = triton.InferInput("text", [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.array(texts, dtype=object))
        return client.infer(model, [tensor]).as_numpy("embedding"), client.get_model_metadata(model)
    finally:
        client.close()


def test_bfloat16_replica_matches_float32(tmp_path, reference):  # noqa: F811
    with run_server(tmp_path, "--dtype", "bfloat16") as server:
        card = httpx.get(f"{server.url}/v1/models").json()["models"][0]
        vectors = openai_embeddings(server, BUNDLED_MODEL, SENTENCES)
    assert card["dtype"] == "bfloat16"
    assert (
        min(cosine(v, r) for v, r in zip(vectors, reference, strict=True)) >= MIN_COSINE["bfloat16"]
    )


def test_int8_replica_agrees_with_float32(tmp_path, reference):  # noqa: F811
    with run_server(tmp_path, "--quantize", "int8") as server:
        vectors, metadata = triton_embeddings(server, BUNDLED_MODEL, SENTENCES)
        scrape = httpx.get(f"{server.url}/metrics").text
    assert metadata["parameters"]["quantize"] == "int8"
    agreement = [cosine(v, r) for v, r in zip(vectors, reference, strict=True)]
    assert min(agreement) >= MIN_COSINE["int8"]
    assert 'batchfit_model_info{device="cpu",dtype="float32"' in scrape


def test_int8_with_half_precision_fails_at_start(tmp_path):
    with (
        pytest.raises(RuntimeError, match="needs --dtype float32"),
        run_server(tmp_path, "--quantize", "int8", "--dtype", "bfloat16", ready_timeout_s=120),
    ):
        pass


def test_custom_model_by_entry_point(tmp_path):
    entry = "python:examples.byte_embedder:create"
    texts = ["hello", "custom models are any torch module", "caf\u00e9"]
    expected = load_model(ModelSpec(model=entry, device="cpu"))
    expected = np.stack(expected.forward(expected.prepare(texts, truncate=True)))
    with run_server(tmp_path, "--model", entry) as server:
        card = httpx.get(f"{server.url}/v1/models").json()["models"][0]
        native = httpx.post(f"{server.url}/v1/infer", json={"inputs": texts}).json()
        via_openai = openai_embeddings(server, "byte-embedder", texts)
        via_v2, metadata = triton_embeddings(server, "byte-embedder", texts)
    assert card["name"] == "byte-embedder"
    assert card["output_dim"] == 64
    assert metadata["outputs"][0]["shape"] == [-1, 64]
    assert native["usage"]["input_tokens"] == 5 + 34 + 5  # UTF-8 bytes
    for got in (np.asarray(native["outputs"], dtype=np.float32), via_openai, via_v2):
        assert got.shape == (3, 64)
        assert np.allclose(got, expected, atol=1e-5)
