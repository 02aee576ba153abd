"""The standard clients (openai, tritonclient) against a real replica serving the bundled model."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from models.spec import BUNDLED_MODEL
from tests.integration.test_server import MODEL, SENTENCES, cosine, metric
from tests.servers import run_server, when_queue_full

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "test-admin-token"
QUEUE_ITEMS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("protocols")
    with run_server(
        folder, "--max-inputs-per-request", str(QUEUE_ITEMS), "--max-queue-items", str(QUEUE_ITEMS),
        "--max-wait-ms", "5",
        "--admin-token", ADMIN_TOKEN, "--profile-dir", str(folder / "profiles"),
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def native(server):
    """The same sentences through our own /v1/infer, to compare the protocols against."""
    response = httpx.post(f"{server.url}/v1/infer", json={"inputs": SENTENCES}, timeout=60)
    assert response.status_code == 200
    return np.asarray(response.json()["outputs"], dtype=np.float32)


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def v2(server):
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=60)
    yield client
    client.close()


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_client_embeddings(client, native, encoding_format):
    # Without encoding_format the client asks for base64 and decodes it itself.
    extra = {"encoding_format": encoding_format} if encoding_format else {}
    response = client.embeddings.create(input=SENTENCES, model=BUNDLED_MODEL, **extra)
    assert response.object == "list"
    assert response.model == BUNDLED_MODEL
    assert [d.index for d in response.data] == list(range(len(SENTENCES)))
    vectors = response.data
    if encoding_format == "base64":  # an explicit base64 request is returned undecoded
        vectors = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in vectors]
    else:
        vectors = [d.embedding for d in vectors]
    for vector, expected in zip(vectors, native, strict=True):
        assert len(vector) == 384
        assert cosine(vector, expected) >= 0.9999
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(SENTENCES)
    assert response._request_id  # our X-Request-ID header


def test_openai_client_single_string(client, native):
    response = client.embeddings.create(input=SENTENCES[0], model=BUNDLED_MODEL)
    assert len(response.data) == 1
    assert cosine(response.data[0].embedding, native[0]) >= 0.9999


@pytest.mark.parametrize(
    ("kwargs", "error", "status", "code", "param"),
    [
        ({"dimensions": 385}, openai.BadRequestError, 400, "invalid_dimensions", "dimensions"),
        ({"dimensions": 0}, openai.BadRequestError, 400, "invalid_dimensions", "dimensions"),
        ({"extra_body": {"prompt_name": "title"}}, openai.BadRequestError, 400, "unknown_prompt",
         "prompt_name"),
        ({"model": "text-embedding-3-small"}, openai.NotFoundError, 404, "model_not_found",
         "model"),
        ({"input": []}, openai.BadRequestError, 400, "empty_input", None),
        ({"input": ["ok", ""]}, openai.BadRequestError, 400, "empty_input", None),
        ({"input": [[101, 2023]]}, openai.BadRequestError, 400, "unsupported_input", "input"),
        ({"input": ["a"] * (QUEUE_ITEMS + 1)}, openai.APIStatusError, 413, "too_many_inputs",
         None),
        ({"extra_body": {"typo": 1}}, openai.BadRequestError, 400, "invalid_request", None),
    ],
)  # fmt: skip
def test_openai_client_errors(client, kwargs, error, status, code, param):
    arguments = {"input": "hello", "model": BUNDLED_MODEL, **kwargs}
    with pytest.raises(error) as info:
        client.embeddings.create(**arguments)
    assert info.value.status_code == status
    assert info.value.code == code
    assert info.value.param == param
    assert info.value.type == "invalid_request_error"
    body = info.value.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]


def test_triton_client_health_and_metadata(v2):
    assert v2.is_server_live()
    assert v2.is_server_ready()
    assert v2.is_model_ready(BUNDLED_MODEL)
    assert v2.is_model_ready(BUNDLED_MODEL, model_version="1")
    assert not v2.is_model_ready("no-such-model")
    assert "binary_tensor_data" in v2.get_server_metadata()["extensions"]
    metadata = v2.get_model_metadata(BUNDLED_MODEL)
    assert metadata["name"] == BUNDLED_MODEL
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("shape", ["flat", "column"])
def test_triton_client_infer(v2, native, binary, shape):
    texts = np.array(SENTENCES, dtype=object)
    if shape == "column":
        texts = texts.reshape(-1, 1)
    tensor = triton.InferInput("text", list(texts.shape), "BYTES")
    tensor.set_data_from_numpy(texts, binary_data=binary)
    wanted = triton.InferRequestedOutput("embedding", binary_data=binary)
    result = v2.infer(BUNDLED_MODEL, [tensor], outputs=[wanted], request_id="req-7")
    embeddings = result.as_numpy("embedding")
    assert embeddings.dtype == np.float32
    assert embeddings.shape == (len(SENTENCES), 384)
    for vector, expected in zip(embeddings, native, strict=True):
        assert cosine(vector, expected) >= 0.9999
    response = result.get_response()
    assert response["id"] == "req-7"
    assert response["model_name"] == BUNDLED_MODEL


def test_triton_client_versioned_infer_and_default_outputs(v2, native):
    tensor = triton.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([SENTENCES[2]], dtype=object))
    result = v2.infer(BUNDLED_MODEL, [tensor], model_version="1")
    assert cosine(result.as_numpy("embedding")[0], native[2]) >= 0.9999


def _bytes_input(name="text", datatype="BYTES", values=("hello",), shape=None):
    tensor = triton.InferInput(name, shape or [len(values)], datatype)
    if datatype == "BYTES":
        tensor.set_data_from_numpy(np.array(values, dtype=object), binary_data=False)
    else:
        tensor.set_data_from_numpy(np.zeros(len(values), dtype=np.float32), binary_data=False)
    return tensor


@pytest.mark.parametrize(
    ("call", "status", "message"),
    [
        (lambda c: c.infer("nope", [_bytes_input()]), 404, "not served here"),
        (lambda c: c.infer(BUNDLED_MODEL, [_bytes_input()], model_version="2"), 404,
         "no version"),
        (lambda c: c.infer(BUNDLED_MODEL, [_bytes_input(name="input_ids")]), 400,
         "named 'text'"),
        (lambda c: c.infer(BUNDLED_MODEL, [_bytes_input(datatype="FP32")]), 400,
         "must be BYTES"),
        (lambda c: c.infer(BUNDLED_MODEL, [_bytes_input(values=("",))]), 400, "empty string"),
        (lambda c: c.infer(BUNDLED_MODEL, [_bytes_input()],
                           outputs=[triton.InferRequestedOutput("logits")]), 400,
         "unknown output"),
        (lambda c: c.infer(BUNDLED_MODEL, [_bytes_input(values=("a",) * (QUEUE_ITEMS + 1))]),
         413, "more than the limit of"),
        (lambda c: c.get_model_metadata("nope"), 404, "not served here"),
    ],
)  # fmt: skip
def test_triton_client_errors(v2, call, status, message):
    with pytest.raises(InferenceServerException) as info:
        call(v2)
    assert info.value.status() == str(status)
    assert message in info.value.message()


def raised(call):
    """What ``call()`` raised (None if it returned)."""
    try:
        call()
    except Exception as exc:
        return exc
    return None


def test_a_full_queue_is_429_in_each_client(server, client, v2):
    full = [("a",) * QUEUE_ITEMS]
    limit = when_queue_full(
        server.url, QUEUE_ITEMS,
        lambda: raised(lambda: client.embeddings.create(input=list(full[0]), model=BUNDLED_MODEL)),
        lambda exc: getattr(exc, "status_code", 200),
    )  # fmt: skip
    assert isinstance(limit, openai.RateLimitError)
    assert (limit.code, limit.type) == ("overloaded", "rate_limit_error")
    assert int(limit.response.headers["retry-after"]) >= 1
    kserve = when_queue_full(
        server.url, QUEUE_ITEMS,
        lambda: raised(lambda: v2.infer(BUNDLED_MODEL, [_bytes_input(values=full[0])])),
        lambda exc: int(exc.status()) if isinstance(exc, InferenceServerException) else 200,
    )  # fmt: skip
    assert "queue is full" in kserve.message()


def test_v2_error_bodies_follow_the_protocol(server):
    url = f"{server.url}/v2/models/{BUNDLED_MODEL}/infer"
    cases = [
        (b"{not json", 400),
        (json.dumps({"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES",
                                 "data": ["only one"]}]}).encode(), 400),
        (json.dumps({"inputs": "text"}).encode(), 400),
    ]  # fmt: skip
    for body, status in cases:
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        assert set(response.json()) == {"error"}
    nested = httpx.post(
        url,
        json={
            "inputs": [
                {"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": [["a"], ["b"]]}
            ]
        },
    )
    assert nested.status_code == 200
    assert nested.json()["outputs"][0]["shape"] == [2, 384]


def test_all_protocols_share_one_queue_and_batcher(server):
    """Concurrent requests over the three APIs are batched together by the one batcher."""

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            before = (await http.get("/metrics")).text
            calls = []
            for k in range(12):
                text = SENTENCES[k % len(SENTENCES)]
                calls.append(http.post("/v1/infer", json={"inputs": [text]}))
                calls.append(
                    http.post("/v1/embeddings", json={"input": text, "model": BUNDLED_MODEL})
                )
                calls.append(
                    http.post(
                        f"/v2/models/{BUNDLED_MODEL}/infer",
                        json={
                            "inputs": [
                                {"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}
                            ]
                        },
                    )
                )
            responses = await asyncio.gather(*calls)
            after = (await http.get("/metrics")).text
            return before, responses, after

    before, responses, after = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses)
    items = metric(after, "batchfit_batch_size_sum", MODEL) - metric(
        before, "batchfit_batch_size_sum", MODEL
    )
    batches = metric(after, "batchfit_batch_size_count", MODEL) - metric(
        before, "batchfit_batch_size_count", MODEL
    )
    assert items == len(responses)
    assert batches < items
    for endpoint in ("/v1/embeddings", "/v2/models/{name}/infer"):
        labels = f'code="200",endpoint="{endpoint}",error_type=""'
        assert metric(after, "batchfit_requests_total", labels) >= 12


def test_profiling_the_next_batches_writes_a_trace(server):
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    url = f"{server.url}/admin/profile"
    assert httpx.post(url, json={"num_batches": 2}).status_code == 401
    armed = httpx.post(url, json={"num_batches": 2}, headers=auth)
    assert armed.status_code == 202, armed.text
    for text in SENTENCES[:2]:  # one request at a time: two batches
        response = httpx.post(f"{server.url}/v1/infer", json={"inputs": [text]}, timeout=60)
        assert response.status_code == 200
    deadline = time.monotonic() + 30
    while (status := httpx.get(url, headers=auth).json())["state"] != "idle":
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    assert status["last_error"] is None
    trace_path = Path(status["last_trace_path"])
    assert trace_path == Path(armed.json()["trace_path"])
    events = json.loads(trace_path.read_text())["traceEvents"]
    batches = [e for e in events if e.get("name", "").startswith("batchfit_batch[")]
    assert len(batches) == 2
    # The forward's aten ops ran on the same thread as the batch markers: the model thread.
    batch_threads = {e["tid"] for e in batches}
    assert len(batch_threads) == 1
    linear = [e for e in events if e.get("name") == "aten::linear"]
    assert linear and {e["tid"] for e in linear} == batch_threads
    assert "wrote a profile of 2 batches" in server.log()
