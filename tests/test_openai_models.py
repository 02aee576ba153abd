"""OpenAI's List models and Retrieve model (GET /v1/models, GET /v1/models/{name}): the official
openai client against a replica on real uvicorn, its API key on."""

import asyncio
import dataclasses
import re
import time

import httpx
import openai
import pytest

from server import Settings, create_app
from server.public_api import is_public_api, nginx_location_regex, public_api_routes
from tests.fakes import ScriptedModel
from tests.inprocess import serve_in_thread

NAME = "all-MiniLM-L6-v2"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def named(name: str, task: str = "embed") -> ScriptedModel:
    model = ScriptedModel()
    model.info = dataclasses.replace(model.info, name=name, task=task)
    return model


@pytest.fixture(scope="module")
def server():
    started_s = int(time.time())
    with serve_in_thread(named(NAME), api_key=KEY) as live:
        live.started_s = started_s
        yield live


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        yield client


def test_the_client_lists_and_retrieves_the_served_model(server, client):
    listed = list(client.models.list())
    assert [model.id for model in listed] == [NAME]
    model = client.models.retrieve(NAME)
    assert (model.id, model.object, model.owned_by) == (NAME, "model", "batchfit")
    assert model.created == listed[0].created
    # The process started before the test's server did, and the number does not move.
    assert isinstance(model.created, int) and 0 < model.created <= server.started_s
    assert client.models.retrieve(NAME).created == model.created


def test_the_list_keeps_our_cards_beside_openais_shape(server):
    body = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert set(body) == {"models", "object", "data"}
    assert [card["name"] for card in body["models"]] == [NAME]
    assert body["models"][0]["task"] == "embed" and body["models"][0]["output_dim"] == 1
    assert body["object"] == "list"
    [entry] = body["data"]
    assert set(entry) == {"id", "object", "created", "owned_by"}
    retrieved = httpx.get(f"{server.url}/v1/models/{NAME}", headers=AUTH)
    assert retrieved.status_code == 200 and retrieved.json() == entry


def test_an_unknown_model_is_404_in_openais_shape(server, client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("nope")
    error = raised.value
    assert (error.status_code, error.code, error.param) == (404, "model_not_found", "model")
    assert error.type == "invalid_request_error"
    body = httpx.get(f"{server.url}/v1/models/nope", headers=AUTH).json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "nope" in body["error"]["message"] and repr(NAME) in body["error"]["message"]


def test_the_api_key_guards_both_routes(server):
    for path in ("/v1/models", f"/v1/models/{NAME}"):
        assert httpx.get(server.url + path).status_code == 401, path
        wrong_key = {"Authorization": "Bearer wrong"}
        assert httpx.get(server.url + path, headers=wrong_key).status_code == 401, path
    with (
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError),
    ):
        wrong.models.retrieve(NAME)


async def test_every_model_in_order_and_a_hub_name_with_a_slash(registry):
    """Several models, the default first; a hub model serves under its hub name, which the
    client sends percent-encoded (``BAAI%2Fbge-small-en-v1.5``)."""
    models = {"BAAI/bge-small-en-v1.5": named("e"), "clf": named("clf", task="classify")}
    app = create_app(Settings(sizer="fixed"), models=models, registry=registry)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
        openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0
        ) as client,
    ):
        async with asyncio.timeout(10):
            while (await http.get("/health/ready")).status_code != 200:
                await asyncio.sleep(0.01)
        assert [m.id async for m in client.models.list()] == list(models)
        hub = await client.models.retrieve("BAAI/bge-small-en-v1.5")
        assert hub.id == "BAAI/bge-small-en-v1.5"
        assert (await client.models.retrieve("clf")).id == "clf"


def test_the_route_is_public_and_in_the_openapi_document():
    app = create_app(Settings())
    assert ("GET", "/v1/models/{name:path}") in {
        (method, route.path) for route in public_api_routes(app) for method in route.methods
    }
    assert is_public_api("/v1/models/all-MiniLM-L6-v2")
    assert re.match(nginx_location_regex(), "/v1/models/all-MiniLM-L6-v2")
    schema = app.openapi()
    retrieve = schema["paths"]["/v1/models/{name}"]["get"]
    ok = retrieve["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/OpenAIModel"}
    missing = retrieve["responses"]["404"]["content"]["application/json"]["schema"]["$ref"]
    assert set(schema["components"]["schemas"][missing.rsplit("/", 1)[1]]["properties"]) == {
        "error"
    }
    listed = schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    listing = schema["components"]["schemas"][
        listed["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    ]
    assert {"models", "object", "data"} <= set(listing["properties"])
