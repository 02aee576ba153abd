"""A generation request's stream as server-sent events, sent as the tokens come.

The response starts only once the request's first events (or its error) are in: every error
before that is an ordinary answer with its status; one after it is an ``error`` event, and
the stream closes. Nginx and other proxies are told not to buffer it (``X-Accel-Buffering``).
"""

from __future__ import annotations

import logging

import orjson
from starlette.types import Receive, Scope, Send

from generation import TokenEvent

from ..errors import to_api_error
from ..runtime import ClientDisconnected, GenerationRun
from .answers import Answer

log = logging.getLogger("batchfit")

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventStream:
    """An ASGI answer that sends ``first`` and then every event of ``run`` as chunks of
    ``answer``, and closes ``run`` on every way out (its sequences cancelled if they still
    run: the client went away, or sending failed)."""

    def __init__(self, run: GenerationRun, first: list[TokenEvent], answer: Answer) -> None:
        self._run = run
        self._first = first
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            events = self._first
            while True:
                body = self._answer.chunks(events)
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                try:
                    events = await self._run.next_events()
                except EOFError:
                    break
            tail = self._answer.tail()
        except ClientDisconnected:
            scope.setdefault("state", {})["error_type"] = "client_disconnected"
            return
        except OSError:  # the connection broke while sending
            return
        except Exception as exc:
            error = to_api_error(exc)  # logs what is not ours
            scope.setdefault("state", {})["error_type"] = error.error_type
            tail = b"data: " + orjson.dumps({
                "error": {"message": error.message, "type": _error_kind(error.status),
                          "param": None, "code": error.error_type},
            }) + b"\n\n"  # fmt: skip
        finally:
            self._run.close()
            trace = scope.get("state", {}).get("trace")
            if trace is not None:
                trace.generated_tokens = self._answer.completion_tokens
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def _error_kind(status: int) -> str:
    if status >= 500:
        return "server_error"
    return "rate_limit_error" if status == 429 else "invalid_request_error"
