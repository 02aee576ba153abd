"""The naive generation server a user would write: transformers' ``generate`` behind FastAPI,
one request at a time (one worker thread), each new token streamed as an OpenAI completion
chunk. torch's default thread count (every core); plain uvicorn, one worker.

``python -m bench.generate.naive --model FOLDER --port 8000`` serves one. It imports nothing
of Batchfit's server.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import torch
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

END = object()


class CompletionBody(BaseModel):
    prompt: str | list[int]
    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    ignore_eos: bool = False


class QueueStreamer(BaseStreamer):
    """Hands each new token id to the event loop (the first ``put`` is the prompt)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[object]) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, END)


class Cancelled(StoppingCriteria):
    """Stops ``generate`` once the client has gone."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> bool:
        return self.event.is_set()


def create_app(folder: str) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    name = Path(folder).name
    worker = ThreadPoolExecutor(1, thread_name_prefix="generate")
    app = FastAPI()

    def chunk(request_id: str, text: str, finish: str | None, usage: dict | None = None) -> bytes:
        choices = [] if usage else [{"index": 0, "text": text, "finish_reason": finish}]
        body = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": name, "choices": choices}  # fmt: skip
        if usage:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    async def tokens(body: CompletionBody, prompt_ids: list[int]) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        gone = threading.Event()
        options = {"max_new_tokens": body.max_tokens, "do_sample": body.temperature > 0,
                   "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
        if body.temperature > 0:
            options["temperature"] = body.temperature
        if body.ignore_eos:
            options["min_new_tokens"] = body.max_tokens

        def run() -> None:
            streamer = QueueStreamer(loop, queue)
            if gone.is_set():  # its client left while it waited for the worker
                streamer.end()
                return
            try:
                with torch.inference_mode():
                    model.generate(torch.tensor([prompt_ids]), streamer=streamer,
                                   stopping_criteria=[Cancelled(gone)], **options)  # fmt: skip
            finally:
                streamer.end()  # again after generate's own: a failure must end the stream too

        # NOTE: the worker thread, not a lock, keeps generations one at a time: a lock
        # released when a client leaves would let the next start before the last had stopped.
        loop.run_in_executor(worker, run)
        try:
            while (token := await queue.get()) is not END:
                yield token  # type: ignore[misc]
        finally:
            gone.set()

    async def stream(body: CompletionBody, prompt_ids: list[int]) -> AsyncIterator[bytes]:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generated: list[int] = []
        sent = ""
        async for token in tokens(body, prompt_ids):
            generated.append(token)
            text = tokenizer.decode(generated, skip_special_tokens=True)
            piece = "" if text.endswith("\ufffd") else text[len(sent) :]
            sent += piece
            yield chunk(request_id, piece, None)
        finish = "length" if len(generated) >= body.max_tokens else "stop"
        yield chunk(request_id, "", finish)
        if (body.stream_options or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(generated),
                     "total_tokens": len(prompt_ids) + len(generated)}  # fmt: skip
            yield chunk(request_id, "", None, usage)
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Response:
        if isinstance(body.prompt, str):
            prompt_ids = tokenizer(body.prompt)["input_ids"]
        else:
            prompt_ids = body.prompt
        if body.stream:
            return StreamingResponse(stream(body, prompt_ids), media_type="text/event-stream")
        generated = [token async for token in tokens(body, prompt_ids)]
        answer = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": [{"index": 0, "finish_reason": "length",
                         "text": tokenizer.decode(generated, skip_special_tokens=True)}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(generated),
                      "total_tokens": len(prompt_ids) + len(generated)},
        }  # fmt: skip
        return Response(orjson.dumps(answer), media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        listed = {"object": "list", "data": [{"id": name, "object": "model"}]}
        return Response(orjson.dumps(listed), media_type="application/json")

    @app.get("/health/ready")
    async def ready() -> Response:
        return Response(b'{"status": "ready"}', media_type="application/json")

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="A transformers causal-LM folder.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_app(args.model), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
