"""Several scripted models behind one app, in process: routing by name, listing, 404s and the
per-model metric series (the integration tests serve real models)."""

import asyncio
import contextlib
import dataclasses
import logging
import re
import threading

import httpx

from server import Settings, create_app
from tests.fakes import ScriptedModel, ScriptedProbe

TIMEOUT = 10


def classifier():
    model = ScriptedModel()
    model.info = dataclasses.replace(model.info, name="scripted-clf", task="classify")
    return model


@contextlib.asynccontextmanager
async def running(models, registry, **settings):
    app = create_app(Settings(sizer="fixed", **settings), models=models, registry=registry)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        async with asyncio.timeout(TIMEOUT):
            while (await client.get("/health/ready")).status_code != 200:
                await asyncio.sleep(0.01)
        yield client


async def test_requests_run_on_the_model_they_name(registry):
    a, b = ScriptedModel(), classifier()
    async with running({"a": a, "b": b}, registry) as client:
        default = await client.post("/v1/infer", json={"inputs": ["x y"]})
        named = await client.post("/v1/infer", json={"inputs": ["p", "q"], "model": "b"})
        listed = (await client.get("/v1/models")).json()["models"]
    served = [[t for t in m.seen if not t.startswith("warm")] for m in (a, b)]  # not warm-up
    assert default.json()["model"] == "a" and served[0] == ["x y"]
    assert named.json()["model"] == "b" and served[1] == ["p", "q"]
    assert [(m["name"], m["task"]) for m in listed] == [("a", "embed"), ("b", "classify")]
    for model, inputs in (("a", 1), ("b", 2)):
        assert registry.get_sample_value("batchfit_inputs_total", {"model": model}) == inputs
        assert registry.get_sample_value("batchfit_batch_size_sum", {"model": model}) == inputs
    duration = {"endpoint": "/v1/infer", "model": "b"}
    assert registry.get_sample_value("batchfit_request_duration_seconds_count", duration) == 1


async def test_unknown_model_is_404_in_each_protocol(registry):
    async with running({"a": ScriptedModel(), "b": classifier()}, registry) as client:
        native = await client.post("/v1/infer", json={"inputs": "x", "model": "zzz"})
        openai = await client.post("/v1/embeddings", json={"input": "x", "model": "zzz"})
        v2 = await client.get("/v2/models/zzz")
        wrong = await client.post("/v1/embeddings", json={"input": "x", "model": "b"})
    assert native.status_code == 404 and native.json()["error_type"] == "model_not_found"
    assert "'a', 'b'" in native.json()["error"]
    assert openai.status_code == 404 and openai.json()["error"]["code"] == "model_not_found"
    assert v2.status_code == 404 and set(v2.json()) == {"error"}
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_task"
    # An unknown name never becomes a label value (cardinality stays bounded).
    labels = {
        s.labels.get("model") for f in registry.collect() for s in f.samples if "model" in s.labels
    }
    assert "zzz" not in labels


async def wait_for_depth(registry, depth):
    async with asyncio.timeout(TIMEOUT):  # a guard against hangs
        while registry.get_sample_value("batchfit_queue_depth") != depth:
            await asyncio.sleep(0.01)


async def test_a_model_at_its_queue_share_gets_429_and_the_other_does_not(registry):
    gate = threading.Event()
    gate.set()  # warm-up runs freely
    gate_model = ScriptedModel(gate=gate)
    async with running({"a": gate_model, "b": classifier()}, registry, max_queue_items=4,
                       max_queue_share=0.5, max_inputs_per_request=2) as client:  # fmt: skip
        gate.clear()
        gate_model.entered.clear()
        first = asyncio.ensure_future(client.post("/v1/infer", json={"inputs": "x"}))
        await asyncio.to_thread(gate_model.entered.wait, TIMEOUT)  # a's batch is running
        held = asyncio.ensure_future(client.post("/v1/infer", json={"inputs": ["1", "2"]}))
        await wait_for_depth(registry, 2)
        full = await client.post("/v1/infer", json={"inputs": "3"})
        other = asyncio.ensure_future(
            client.post("/v1/infer", json={"inputs": ["4", "5"], "model": "b"})
        )
        await wait_for_depth(registry, 4)
        gate.set()
        answers = await asyncio.gather(first, held, other)
    assert full.status_code == 429 and "model 'a' holds its share" in full.json()["error"]
    assert [r.status_code for r in answers] == [200, 200, 200]


async def test_the_ready_line_names_every_model_default_first(registry, caplog):
    caplog.set_level(logging.INFO, logger="batchfit")
    async with running({"a": ScriptedModel(), "b": classifier()}, registry):
        pass
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in")]
    expected = " serves a (embed: 1 dims), b (classify) on cpu, float32; a: fixed batches ("
    assert expected in line, line
    assert (
        "; b: fixed batches (at most 128 items, 4096 padded tokens); longest proven input 32 "
        "tokens of 64; status page" in line
    ), line


async def test_the_ready_line_gives_every_models_memory_budget(registry, caplog):
    caplog.set_level(logging.INFO, logger="batchfit")
    app = create_app(
        Settings(sizer="adaptive", memory_headroom=0.25, max_batch_size=16),
        models={"a": ScriptedModel(), "b": classifier()}, registry=registry,
        probe=ScriptedProbe(free_bytes=1000 * 2**20),
    )  # fmt: skip
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        async with asyncio.timeout(TIMEOUT):
            while (await client.get("/health/ready")).status_code != 200:
                await asyncio.sleep(0.01)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in")]
    budget = (
        r"memory budget [\d,]+ MiB per batch \([^)]*free 1,000 MiB less 25% headroom[^;]*; "
        r"at most 16"
    )
    proven = "; longest proven input 64 tokens of 64"
    assert re.search(rf"; a: {budget}[^;]*{proven}; b: {budget}[^;]*{proven}; status page", line), (
        line
    )
