"""OpenAI and KServe v2 routes in process, over a fake embedding model; and /openapi.json."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from fastapi.routing import APIRoute

from models import Item
from server import Settings, create_app
from tests.fakes import ScriptedModel
from tests.test_app import running


class VectorModel(ScriptedModel):
    """Embeds a text as [number of words, length in characters, 1]."""

    def forward(self, items: Sequence[Item]) -> list[np.ndarray]:
        super().forward(items)
        return [np.array([len(i.data.split()), len(i.data), 1.0], np.float32) for i in items]


def v2_body(texts, **extra):
    tensor = {"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}
    return {"inputs": [tensor], **extra}


async def test_openai_float_and_base64(registry):
    async with running(VectorModel(), registry) as client:
        body = {"input": ["a b", "c"], "model": "scripted"}
        floats = (await client.post("/v1/embeddings", json=body)).json()
        b64 = await client.post("/v1/embeddings", json={**body, "encoding_format": "base64"})
    assert floats["data"][0] == {"object": "embedding", "index": 0, "embedding": [2.0, 3.0, 1.0]}
    assert floats["usage"] == {"prompt_tokens": 4 + 3, "total_tokens": 7}
    decoded = np.frombuffer(base64.b64decode(b64.json()["data"][1]["embedding"]), "<f4")
    assert decoded.tolist() == [1.0, 1.0, 1.0]


async def test_v2_json_and_binary_outputs(registry):
    async with running(VectorModel(), registry) as client:
        plain = await client.post("/v2/models/scripted/infer", json=v2_body(["a b", "c"], id="x"))
        binary = await client.post(
            "/v2/models/scripted/infer",
            json=v2_body(["a b"], parameters={"binary_data_output": True}),
        )
    assert plain.json() == {
        "model_name": "scripted", "model_version": "1", "id": "x",
        "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [2, 3],
                     "data": [2.0, 3.0, 1.0, 1.0, 1.0, 1.0]}],
    }  # fmt: skip
    header_length = int(binary.headers["inference-header-content-length"])
    header = json.loads(binary.content[:header_length])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert np.frombuffer(binary.content[header_length:], "<f4").tolist() == [2.0, 3.0, 1.0]


async def test_v2_binary_input(registry):
    texts = [b"hello world", "caf\u00e9".encode()]
    raw = b"".join(len(t).to_bytes(4, "little") + t for t in texts)
    tensor = {"name": "text", "shape": [2], "datatype": "BYTES"}
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = json.dumps({"inputs": [tensor]}).encode()
    async with running(VectorModel(), registry) as client:
        good = await client.post(
            "/v2/models/scripted/infer", content=header + raw,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )  # fmt: skip
        truncated = await client.post(
            "/v2/models/scripted/infer", content=header + raw[:-2],
            headers={"Inference-Header-Content-Length": str(len(header))},
        )  # fmt: skip
        too_long = await client.post(
            "/v2/models/scripted/infer", content=header,
            headers={"Inference-Header-Content-Length": str(len(header) + 5)},
        )  # fmt: skip
    assert good.status_code == 200, good.text
    assert good.json()["outputs"][0]["data"][:2] == [2.0, 11.0]
    assert good.json()["outputs"][0]["data"][4] == 4.0  # "café" is 4 characters
    assert truncated.status_code == 400
    assert too_long.status_code == 400
    assert set(too_long.json()) == {"error"}


async def test_not_ready_answers_in_each_protocols_shape(registry):
    gate = threading.Event()
    async with running(VectorModel(gate=gate), registry, wait_ready=False) as client:
        ready = await client.get("/v2/health/ready")
        live = await client.get("/v2/health/live")
        infer = await client.post("/v2/models/scripted/infer", json=v2_body(["a"]))
        openai = await client.post("/v1/embeddings", json={"input": "a", "model": "scripted"})
        gate.set()
        async with asyncio.timeout(10):
            while (await client.get("/v2/health/ready")).status_code != 200:
                await asyncio.sleep(0.01)
        model_ready = await client.get("/v2/models/scripted/versions/1/ready")
    assert (ready.status_code, ready.json()) == (503, {"ready": False})
    assert (live.status_code, live.json()) == (200, {"live": True})
    assert infer.status_code == 503 and set(infer.json()) == {"error"}
    assert infer.headers["retry-after"] == "1"
    assert openai.status_code == 503
    assert openai.json()["error"]["type"] == "server_error"
    assert openai.json()["error"]["code"] == "not_ready"
    assert model_ready.json() == {"name": "scripted", "ready": True}


async def test_classifier_outputs_on_v2_and_refused_on_openai(registry):
    class Classifier(ScriptedModel):
        def forward(self, items):
            super().forward(items)
            return [{"label": "positive", "score": 0.75} for _ in items]

    model = Classifier()
    model.info = dataclasses.replace(model.info, task="classify")
    async with running(model, registry) as client:
        v2 = await client.post("/v2/models/scripted/infer", json=v2_body(["a", "b"]))
        meta = await client.get("/v2/models/scripted")
        openai = await client.post("/v1/embeddings", json={"input": "a", "model": "scripted"})
    outputs = {o["name"]: o for o in v2.json()["outputs"]}
    assert outputs["label"] == {"name": "label", "datatype": "BYTES", "shape": [2],
                                "data": ["positive", "positive"]}  # fmt: skip
    assert outputs["score"]["data"] == [0.75, 0.75]
    assert [o["name"] for o in meta.json()["outputs"]] == ["label", "score"]
    assert openai.status_code == 400
    assert openai.json()["error"]["code"] == "wrong_task"


def test_openapi_describes_every_route():
    app = create_app(Settings(admin_token="x"))
    schema = app.openapi()
    paths = schema["paths"]
    for route in app.routes:
        if isinstance(route, APIRoute) and route.include_in_schema:
            path = route.path_format
            assert path in paths, path
            for method in route.methods - {"HEAD"}:
                assert method.lower() in paths[path], (path, method)
    embeddings = paths["/v1/embeddings"]["post"]
    ref = embeddings["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request_schema = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(request_schema["properties"]) == {
        "input", "model", "encoding_format", "dimensions", "user", "prompt_name", "prompt",
        "embed_dtype", "embedding_types", "truncate", "late_chunks",
    }  # fmt: skip
    assert "OpenAIErrorBody" in json.dumps(embeddings["responses"]["400"])
    for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
        infer = paths[path]["post"]
        content = infer["requestBody"]["content"]
        assert set(content) == {"application/json", "application/octet-stream"}
        assert "inputs" in content["application/json"]["schema"]["properties"]
        assert "V2Error" in json.dumps(infer["responses"]["404"])
        params = {p["name"]: p["in"] for p in infer["parameters"]}
        assert params == ({"name": "path", "version": "path"} if "version" in path
                          else {"name": "path"})  # fmt: skip
    for path in ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}",
                 "/v2/models/{name}/ready", "/admin/profile", "/v1/infer"):  # fmt: skip
        assert path in paths
    assert "/metrics" not in paths


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [1]}]},
         "not text"),
        ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES"}]}, "has no data"),
        (v2_body(["a"], parameters={"truncate": "yes"}), "truncate must be a boolean"),
        (v2_body(["a"], parameters={"timeout_s": -1}), "timeout_s must be a positive"),
        ({"inputs": []}, "exactly one input"),
        (v2_body(["a"], outputs=[{"name": "logits"}]), "unknown output 'logits'"),
    ],
)  # fmt: skip
async def test_v2_bad_requests(registry, body, message):
    model = VectorModel()
    async with running(model, registry) as client:
        warm = len(model.batch_sizes)
        response = await client.post("/v2/models/scripted/infer", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]
    assert len(model.batch_sizes) == warm  # refused before the queue


@pytest.mark.parametrize(
    ("path", "shape"), [("/v1/embeddings", "openai"), ("/v2/models/scripted/infer", "v2")]
)
async def test_a_body_that_is_not_utf8_is_a_400_in_the_protocols_shape(registry, path, shape):
    # Found by schemathesis: FastAPI raises its own HTTPException for such a body.
    async with running(VectorModel(), registry) as client:
        response = await client.post(
            path, content=b"i\xff", headers={"content-type": "application/json"}
        )
    assert response.status_code == 400, response.text
    body = response.json()
    if shape == "openai":
        assert body["error"]["code"] == "invalid_json"
    else:
        assert set(body) == {"error"}
    assert registry.get_sample_value(
        "batchfit_requests_total", {"endpoint": path if shape == "openai" else
                                    "/v2/models/{name}/infer", "code": "500",
                                    "error_type": "internal_error"}
    ) is None  # fmt: skip
