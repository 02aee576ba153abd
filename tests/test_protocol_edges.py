"""The protocols' routes at their edges, as docs/protocols.md and docs/errors.md say:
each error in the route's own shape (401 and 405 included), schema errors 400 on the protocol
routes, 415 for a body that is not JSON, strict types, 400 ``invalid_json`` for an empty or
unparsable body on every route, and 503 ``draining`` on v2 once the replica drains."""

from __future__ import annotations

import json

import openai
import pytest

from tests.test_app import assert_error, running
from tests.test_protocol_routes import VectorModel, v2_body

KEY = "edge-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EMBEDDINGS = "/v1/embeddings"
V2_INFER = "/v2/models/scripted/infer"
V2_ENDPOINT = "/v2/models/{name}/infer"  # the metrics label of every v2 infer path


def embedding_body(**extra):
    return {"input": "a b", "model": "scripted", **extra}


def assert_openai_error(response, status, code, param=None, kind="invalid_request_error"):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"] == {
        "message": body["error"]["message"], "type": kind, "param": param, "code": code,
    }  # fmt: skip
    assert response.headers["x-request-id"]
    return body["error"]


def assert_v2_error(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    assert response.headers["x-request-id"]
    return body["error"]


def error_count(registry, endpoint, status, error_type):
    labels = {"endpoint": endpoint, "code": str(status), "error_type": error_type}
    return registry.get_sample_value("batchfit_requests_total", labels) or 0


# --- 1: 401 and 405 in each route's shape ---


async def test_a_missing_or_wrong_key_is_a_401_in_each_routes_shape(registry):
    async with running(VectorModel(), registry, api_key=KEY) as client:
        missing = await client.post(EMBEDDINGS, json=embedding_body())
        wrong = await client.post(
            EMBEDDINGS, json=embedding_body(), headers={"Authorization": "Bearer nope"}
        )
        v2 = await client.post(V2_INFER, json=v2_body(["a"]))
        v2_metadata = await client.get("/v2")
        native = await client.post("/v1/infer", json={"inputs": "a"})
        allowed = await client.post(EMBEDDINGS, json=embedding_body(), headers=AUTH)
    for response, message in ((missing, "missing API key"), (wrong, "invalid API key")):
        error = assert_openai_error(response, 401, "unauthorized")
        assert error["message"] == message
        assert response.headers["www-authenticate"] == "Bearer"
    for response in (v2, v2_metadata):
        assert assert_v2_error(response, 401) == "missing API key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert_error(native, 401, "unauthorized")  # ours, as before
    assert allowed.status_code == 200
    assert error_count(registry, EMBEDDINGS, 401, "unauthorized") == 2
    assert error_count(registry, V2_ENDPOINT, 401, "unauthorized") == 1


async def test_the_openai_client_raises_its_authentication_error_with_our_code(registry):
    async with (
        running(VectorModel(), registry, api_key=KEY) as http,
        openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="wrong", http_client=http, max_retries=0
        ) as client,
    ):
        with pytest.raises(openai.AuthenticationError) as raised:
            await client.embeddings.create(input="a", model="scripted")
    error = raised.value
    assert (error.status_code, error.code, error.type) == (
        401, "unauthorized", "invalid_request_error",
    )  # fmt: skip
    assert error.body == {
        "message": "invalid API key", "type": "invalid_request_error", "param": None,
        "code": "unauthorized",
    }  # fmt: skip
    assert error.request_id  # our X-Request-ID header


async def test_another_method_is_a_405_in_each_routes_shape(registry):
    async with running(VectorModel(), registry) as client:
        embeddings = await client.get(EMBEDDINGS)
        v2_infer = await client.put(V2_INFER, json=v2_body(["a"]))  # a lean route
        v2_ready = await client.post("/v2/health/ready")  # a framework-routed one
        native = await client.get("/v1/infer")
    error = assert_openai_error(embeddings, 405, "method_not_allowed")
    assert error["message"] == "Method Not Allowed"
    assert embeddings.headers["allow"] == "POST"
    assert assert_v2_error(v2_infer, 405) == "Method Not Allowed"
    assert v2_infer.headers["allow"] == "POST"
    assert assert_v2_error(v2_ready, 405) == "Method Not Allowed"
    assert v2_ready.headers["allow"] == "GET"
    assert_error(native, 405, "method_not_allowed")  # ours, as before
    assert native.headers["allow"] == "POST"
    assert error_count(registry, EMBEDDINGS, 405, "method_not_allowed") == 1


# --- 2: schema errors found by the route are 400 on the protocols' routes ---


SURROGATE_INPUT = b'{"input": ["ok", "\\ud800"], "model": "scripted"}'
SURROGATE_PROMPT = b'{"input": "ok", "model": "scripted", "prompt": "\\ud800"}'
SURROGATE_V2 = json.dumps(v2_body(["ok", "\ud800"]), ensure_ascii=True).encode()


@pytest.mark.parametrize(
    ("path", "content", "needle"),
    [
        (EMBEDDINGS, SURROGATE_INPUT, "input 1 is not valid Unicode"),
        (EMBEDDINGS, SURROGATE_PROMPT, "prompt is not valid Unicode"),
        (EMBEDDINGS, json.dumps(embedding_body(prompt="x", prompt_name="q")).encode(),
         "not both"),
        (V2_INFER, SURROGATE_V2, "input 1 is not valid Unicode"),
        (V2_INFER, json.dumps(v2_body(["ok"], parameters={"prompt": "\ud800"})).encode(),
         "prompt is not valid Unicode"),
        (V2_INFER, json.dumps(v2_body(["ok"], parameters={"prompt": "x", "prompt_name": "q"}))
         .encode(), "not both"),
    ],
    ids=["openai-input", "openai-prompt", "openai-both", "v2-input", "v2-prompt", "v2-both"],
)  # fmt: skip
async def test_lone_surrogates_and_both_prompts_are_400_on_the_protocols(
    registry, path, content, needle
):
    model = VectorModel()
    async with running(model, registry) as client:
        warm = len(model.batch_sizes)
        response = await client.post(
            path, content=content, headers={"content-type": "application/json"}
        )
    if path == EMBEDDINGS:
        message = assert_openai_error(response, 400, "invalid_request")["message"]
    else:
        message = assert_v2_error(response, 400)
        assert error_count(registry, V2_ENDPOINT, 400, "invalid_request") == 1
    assert needle in message
    assert len(model.batch_sizes) == warm  # refused before the queue


async def test_on_our_own_route_they_stay_422(registry):
    async with running(VectorModel(), registry) as client:
        surrogate = await client.post(
            "/v1/infer", content=b'{"inputs": ["ok", "\\ud800"]}',
            headers={"content-type": "application/json"},
        )  # fmt: skip
        both = await client.post(
            "/v1/infer", json={"inputs": "a", "prompt": "", "prompt_name": "q"}
        )
    assert "not valid Unicode" in assert_error(surrogate, 422, "invalid_request")["error"]
    assert "not both" in assert_error(both, 422, "invalid_request")["error"]


# --- 3: a body declared as something other than JSON is 415 ---


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
async def test_a_body_declared_as_not_json_is_a_415(registry, content_type):
    headers = {"content-type": content_type}
    async with running(VectorModel(), registry) as client:
        openai_answer = await client.post(
            EMBEDDINGS, content=json.dumps(embedding_body()), headers=headers
        )
        v2_answer = await client.post(V2_INFER, content=json.dumps(v2_body(["a"])), headers=headers)
        v2_binary = await client.post(
            V2_INFER, content=json.dumps(v2_body(["a"])),
            headers={"content-type": "application/octet-stream"},
        )  # fmt: skip
        no_type = await client.post(V2_INFER, content=json.dumps(v2_body(["a"])))
    error = assert_openai_error(openai_answer, 415, "unsupported_media_type")
    assert content_type in error["message"]
    assert content_type in assert_v2_error(v2_answer, 415)
    assert error_count(registry, V2_ENDPOINT, 415, "unsupported_media_type") == 1
    # Triton's binary tensor data is welcome on v2, and tritonclient declares no type at all.
    assert v2_binary.status_code == 200, v2_binary.text
    assert "content-type" not in no_type.request.headers
    assert no_type.status_code == 200, no_type.text


# --- 4: strict types ---


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"dimensions": True}, "dimensions"),
        ({"dimensions": "1"}, "dimensions"),
        ({"dimensions": 1.0}, "dimensions"),
        ({"encoding_format": 1}, "encoding_format"),
        ({"user": 5}, "user"),
        ({"prompt_name": True}, "prompt_name"),
        ({"typo": 1}, None),  # no parameter of the API
    ],
)
async def test_openai_fields_are_strict(registry, extra, param):
    model = VectorModel()
    async with running(model, registry) as client:
        warm = len(model.batch_sizes)
        response = await client.post(EMBEDDINGS, json=embedding_body(**extra))
    error = assert_openai_error(response, 400, "invalid_request", param=param)
    assert error["message"].startswith(f"{next(iter(extra))}: ")
    assert len(model.batch_sizes) == warm


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (v2_body(["a"], parameters={"timeout_s": True}), "timeout_s must be a positive number"),
        (v2_body(["a"], parameters={"timeout_s": "5"}), "timeout_s must be a positive number"),
        (v2_body(["a"], parameters={"binary_data_output": "yes"}),
         "binary_data_output must be a boolean"),
        (v2_body(["a"], outputs=[{"name": "embedding", "parameters": {"binary_data": 1}}]),
         "binary_data must be a boolean"),
        ({"inputs": [{"name": "text", "shape": [True], "datatype": "BYTES", "data": ["a"]}]},
         "shape"),
        ({"inputs": [{"name": "text", "shape": ["1"], "datatype": "BYTES", "data": ["a"]}]},
         "shape"),
    ],
    ids=["timeout-bool", "timeout-string", "binary-output", "binary-data", "shape-bool",
         "shape-string"],
)  # fmt: skip
async def test_v2_parameters_and_shapes_are_strict(registry, body, needle):
    model = VectorModel()
    async with running(model, registry) as client:
        warm = len(model.batch_sizes)
        response = await client.post(V2_INFER, json=body)
        good = await client.post(V2_INFER, json=v2_body(["a"], parameters={"timeout_s": 5}))
    assert needle in assert_v2_error(response, 400)
    assert len(model.batch_sizes) == warm + 1  # only the good one ran
    assert good.status_code == 200


# --- 5: an empty or unparsable body is 400 invalid_json on every route ---


@pytest.mark.parametrize("content", [b"", b'{"input":', b"not json"], ids=["empty", "cut", "text"])
@pytest.mark.parametrize("path", ["/v1/infer", "/v1/rerank", EMBEDDINGS, V2_INFER])
async def test_an_empty_or_unparsable_body_is_invalid_json_everywhere(registry, path, content):
    async with running(VectorModel(), registry) as client:
        response = await client.post(
            path, content=content, headers={"content-type": "application/json"}
        )
    if path == EMBEDDINGS:
        message = assert_openai_error(response, 400, "invalid_json")["message"]
    elif path == V2_INFER:
        message = assert_v2_error(response, 400)
        assert error_count(registry, V2_ENDPOINT, 400, "invalid_json") == 1
    else:
        message = assert_error(response, 400, "invalid_json")["error"]
    assert message == (
        "request body is empty; send a JSON object" if not content
        else "request body is not valid JSON"
    )  # fmt: skip


# --- 6: v2 infer while draining ---


async def test_v2_infer_while_draining_is_503_draining_as_everywhere(registry):
    async with running(VectorModel(), registry) as client:
        client._transport.app.state.runtime.begin_drain()
        v2 = await client.post(V2_INFER, json=v2_body(["a"]))
        versioned = await client.post("/v2/models/scripted/versions/1/infer", json=v2_body(["a"]))
        embeddings = await client.post(EMBEDDINGS, json=embedding_body())
        not_json = await client.post(
            EMBEDDINGS, content=b"x", headers={"content-type": "text/plain"}
        )
        native = await client.post("/v1/infer", json={"inputs": "a"})
    for response in (v2, versioned):
        assert "shutting down" in assert_v2_error(response, 503)
        assert response.headers["retry-after"] == "1"
    assert error_count(registry, V2_ENDPOINT, 503, "draining") == 2
    for response in (embeddings, not_json):  # draining first, as /v1/infer
        assert_openai_error(response, 503, "draining", kind="server_error")
    assert_error(native, 503, "draining")
