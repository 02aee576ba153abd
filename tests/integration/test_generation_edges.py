"""The generation routes' bad inputs and hard moments, on a real uvicorn serving tiny
generators (one with a chat template, one without) and the bundled embedder: every 4xx in
OpenAI's shape naming the limit and the value, 429 with Retry-After, 504 before the first
token, and a drain that lets running streams finish while new and waiting ones get 503."""

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.generators import tiny_generator
from tests.servers import run_server

pytestmark = pytest.mark.integration

CONTEXT = 64


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    chat = tiny_generator(root, "llama")
    plain = tiny_generator(root / "plain", "qwen3", chat_template=False)
    with run_server(
        root, "--model", f"chat={chat}", "--model", f"plain={plain}",
        "--model", "emb=all-MiniLM-L6-v2", "--max-input-tokens", str(CONTEXT),
        "--max-running-seqs", "1", "--max-queue-items", "2", "--max-inputs-per-request", "2",
    ) as server:  # fmt: skip
        yield server


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kw)


def openai_error(response: httpx.Response, status: int, code: str, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    kind = {429: "rate_limit_error"}.get(status, "server_error" if status >= 500 else None)
    assert error["type"] == (kind or "invalid_request_error")
    return error["message"]


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param", "says"),
    [
        ("/v1/completions", {"prompt": "word " * 100}, 400, "context_length_exceeded",
         "prompt", f"context is {CONTEXT} tokens"),
        ("/v1/completions", {"prompt": "hi there", "max_tokens": 60}, 400,
         "context_length_exceeded", "max_tokens", "max_tokens is 60"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 64}, 400,
         "context_length_exceeded", "max_completion_tokens", "max_completion_tokens is 64"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
         "invalid_parameter", "messages", "messages[0].role is 'tool'"),
        ("/v1/completions", {"prompt": "hi", "n": 9}, 400, "invalid_parameter", "n",
         "n is at most 8, got 9"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 6}, 400,
         "invalid_parameter", "top_logprobs", "top_logprobs is at most 5, got 6"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "invalid_parameter",
         "logprobs", "logprobs is at most 5, got 6"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400,
         "invalid_parameter", "stop", "at most 4 strings, got 5"),
        ("/v1/completions", {"prompt": [99999]}, 400, "invalid_parameter", "prompt",
         "token id 99999 is outside the vocabulary"),
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "invalid_request",
         "temperature", "less than or equal to 2"),
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400,
         "unsupported_parameter", "frequency_penalty", "only 0"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400,
         "unsupported_parameter", "tools", "tools are not supported"),
        ("/v1/completions", {"prompt": ""}, 400, "empty_input", "prompt", "prompt is empty"),
        ("/v1/chat/completions", {"messages": CHAT, "model": "plain"}, 400, "no_chat_template",
         "messages", "has no chat template"),
        ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404, "model_not_found", "model",
         "'nope' is not served"),
        ("/v1/completions", {"prompt": "hi", "model": "emb"}, 400, "wrong_task", "model",
         "does embed"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_4xx_in_openais_shape(replica, path, body, status, code, param,
                                                   says):  # fmt: skip
    message = openai_error(post(replica.url, path, {"model": "chat", **body}), status, code, param)
    assert says in message


def stream_lines(url: str, body: dict, into: list[str]) -> int:
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            into.append(line)
        return response.status_code


def waiting_sequences(url: str) -> float:
    scrape = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r'^batchfit_generation_waiting_sequences{model="chat"} (\S+)$', scrape,
                      re.MULTILINE)  # fmt: skip
    assert match, "no batchfit_generation_waiting_sequences in the scrape"
    return float(match.group(1))


LONG = {"model": "chat", "prompt": "one", "max_tokens": 62, "ignore_eos": True, "stream": True}
# Long enough to be running while the other requests arrive, even on a fast host.


def test_a_full_waiting_queue_is_429_with_retry_after_and_a_late_first_token_is_504(replica):
    """One sequence runs at a time (--max-running-seqs 1) and two may wait."""
    with ThreadPoolExecutor(3) as pool:
        lines: list[list[str]] = [[], [], []]
        running = [pool.submit(stream_lines, replica.url, LONG, lines[i]) for i in range(3)]
        deadline = time.monotonic() + 30
        while waiting_sequences(replica.url) < 2:
            assert time.monotonic() < deadline, "the requests never filled the waiting queue"
            time.sleep(0.01)
        response = post(replica.url, "/v1/completions", {**LONG, "stream": False})
        openai_error(response, 429, "overloaded", None)
        assert response.headers["retry-after"] == "1"
        late = post(replica.url, "/v1/completions",
                    {"model": "chat", "prompt": "hi", "timeout_s": 0.01})  # fmt: skip
        assert [f.result() for f in running] == [200, 200, 200]
    assert late.status_code in (429, 504), late.text
    if late.status_code == 504:
        openai_error(late, 504, "deadline_exceeded", None)
    assert all(chunk[-1] == "data: [DONE]" for chunk in [[x for x in lines[i] if x]
                                                         for i in range(3)])  # fmt: skip


def test_sigterm_lets_a_running_stream_finish_and_refuses_new_and_waiting_work(tmp_path):
    folder = tiny_generator(tmp_path, "llama")
    with run_server(tmp_path, "--model", f"chat={folder}", "--max-running-seqs", "1",
                    "--drain-timeout-s", "60") as server:  # fmt: skip
        body = {**LONG, "max_tokens": 400}
        lines: list[str] = []
        waiting_lines: list[str] = []
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(stream_lines, server.url, body, lines)
            while not any(line.startswith("data:") for line in lines):
                assert not running.done(), (running.result(), lines)
                time.sleep(0.01)
            waiting = pool.submit(stream_lines, server.url, {**body, "stream": False},
                                  waiting_lines)  # fmt: skip
            time.sleep(0.2)
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            refused = post(server.url, "/v1/completions", {**body, "stream": False})
            assert running.result() == 200
            assert waiting.result() == 503
        openai_error(refused, 503, "draining", None)
        data = [line for line in lines if line.startswith("data:")]
        assert data[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in data[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(30) == 0


def test_models_lists_the_generators_with_their_context_length(replica):
    cards = {card["name"]: card for card in httpx.get(f"{replica.url}/v1/models").json()["models"]}
    assert cards["chat"]["task"] == cards["plain"]["task"] == "generate"
    assert cards["chat"]["context_length"] == CONTEXT and cards["emb"]["context_length"] is None
