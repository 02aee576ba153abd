"""Long inputs on a real replica (uvicorn on a loopback port), in one process and behind API
processes: ``truncate: chunk`` and ``late_chunks`` on /v1/infer, /v1/embeddings (the openai
client) and /v2, checked against sentence-transformers on the same windows and spans; the
server's ``--truncate`` default; windows cached like any input."""

from __future__ import annotations

import re

import httpx
import numpy as np
import openai
import pytest
from sentence_transformers import SentenceTransformer

from models.loading import resolve_model_path
from models.spec import BUNDLED_MODEL
from tests.servers import run_server
from tests.test_long_inputs import DOC, LONG, SPANS, chunked_reference, late_reference

pytestmark = pytest.mark.integration

CACHE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def st_model():
    return SentenceTransformer(str(resolve_model_path(BUNDLED_MODEL)), device="cpu")


@pytest.fixture(scope="module", params=["one process", "api workers"])
def server(request, tmp_path_factory):
    workers = ("--api-workers", "2") if request.param == "api workers" else ()
    with run_server(
        tmp_path_factory.mktemp("long"), "--truncate", "none",
        "--cache-bytes", str(CACHE_BYTES), *workers,
    ) as server:  # fmt: skip
        yield server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def cache_hits(server) -> float:
    scrape = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(
        rf'^batchfit_cache_hits_total{{model="{BUNDLED_MODEL}"}} (\S+)$', scrape, re.MULTILINE
    )
    return float(match.group(1)) if match else 0.0


def test_chunked_inputs_match_the_reference_and_are_cached_per_window(server, st_model):
    body = {"inputs": [LONG, "A short one."], "truncate": "chunk"}
    answer = post(server, "/v1/infer", body)
    assert answer.status_code == 200, answer.text
    outputs = np.asarray(answer.json()["outputs"], dtype=np.float32)
    assert outputs.shape == (2, 384)
    assert float(outputs[0] @ chunked_reference(st_model, LONG)) > 0.9999
    assert float(outputs[1] @ st_model.encode("A short one.")) > 0.9999
    # Every window's tokens: the text's own, and [CLS] and [SEP] in each of its 4 windows.
    content = len(st_model.tokenizer(LONG, add_special_tokens=False)["input_ids"])
    tokens = content + 4 * 2 + len(st_model.tokenizer("A short one.")["input_ids"])
    assert answer.json()["usage"]["input_tokens"] == tokens
    before = cache_hits(server)
    again = post(server, "/v1/infer", body)
    assert np.array_equal(np.asarray(again.json()["outputs"], dtype=np.float32), outputs)
    assert cache_hits(server) - before == 4 + 1  # each window, from cache
    # Matryoshka: the pooled vector cut and renormalised.
    cut = post(server, "/v1/infer", {**body, "dimensions": 128}).json()["outputs"][0]
    want = chunked_reference(st_model, LONG)[:128]
    assert float(np.dot(cut, want / np.linalg.norm(want))) > 0.9999


def test_the_server_default_refuses_and_a_request_chooses_its_own(server, st_model):
    refused = post(server, "/v1/infer", {"inputs": [LONG]})  # --truncate none
    assert refused.status_code == 413
    assert refused.json()["error_type"] == "input_too_long"
    assert "maximum of 256" in refused.json()["error"]
    kept = post(server, "/v1/infer", {"inputs": [LONG], "truncate": "end"})
    assert kept.status_code == 200, kept.text
    assert float(np.dot(kept.json()["outputs"][0], st_model.encode(LONG))) > 0.9999
    assert post(server, "/v1/infer", {"inputs": [LONG], "truncate": True}).status_code == 200
    wrong = post(server, "/v1/infer", {"inputs": [LONG], "truncate": "middle"})
    assert wrong.status_code == 422 and wrong.json()["error_type"] == "invalid_request"


def test_late_chunks_on_infer_match_the_reference(server, st_model):
    answer = post(server, "/v1/infer", {"inputs": DOC, "late_chunks": [list(s) for s in SPANS]})
    assert answer.status_code == 200, answer.text
    (vectors,) = answer.json()["outputs"]
    reference = late_reference(st_model, DOC, SPANS)
    np.testing.assert_array_less(0.9999, np.sum(np.asarray(vectors) * reference, axis=1))
    nested = post(server, "/v1/infer", {"inputs": [DOC, "Another document."],
                                        "late_chunks": [[[0, 23]], [[0, 7], [8, 17]]]})  # fmt: skip
    assert [len(v) for v in nested.json()["outputs"]] == [1, 2]
    too_long = post(server, "/v1/infer", {"inputs": LONG, "late_chunks": [[0, 10]]})
    assert too_long.status_code == 413 and "one pass" in too_long.json()["error"]
    outside = post(server, "/v1/infer", {"inputs": DOC, "late_chunks": [[0, 1000]]})
    assert outside.status_code == 400 and outside.json()["error_type"] == "invalid_late_chunks"


def test_the_openai_client_gets_chunked_and_late_chunked_embeddings(server, st_model):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        chunked = client.embeddings.create(
            input=[LONG], model=BUNDLED_MODEL, extra_body={"truncate": "chunk"}
        )
        assert float(np.dot(chunked.data[0].embedding, chunked_reference(st_model, LONG))) > 0.9999
        late = client.embeddings.create(
            input=[DOC], model=BUNDLED_MODEL,
            extra_body={"late_chunks": [list(s) for s in SPANS]},
        )  # fmt: skip
        assert [d.index for d in late.data] == list(range(len(SPANS)))
        assert [d.chunk_index for d in late.data] == list(range(len(SPANS)))
        reference = late_reference(st_model, DOC, SPANS)
        for got, want in zip(late.data, reference, strict=True):
            assert float(np.dot(got.embedding, want)) > 0.9999
        with pytest.raises(openai.APIStatusError) as refused:
            client.embeddings.create(input=[LONG], model=BUNDLED_MODEL)
    assert refused.value.status_code == 413
    assert refused.value.body["code"] == "input_too_long"


def test_kserve_takes_truncate_chunk(server, st_model):
    answer = post(server, f"/v2/models/{BUNDLED_MODEL}/infer", {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [LONG]}],
        "parameters": {"truncate": "chunk"},
    })  # fmt: skip
    assert answer.status_code == 200, answer.text
    vector = np.asarray(answer.json()["outputs"][0]["data"], dtype=np.float32)
    assert float(vector @ chunked_reference(st_model, LONG)) > 0.9999
