"""Pure ASGI middleware: request ids, the body-size limit, and request metrics."""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body
from .metrics import ServerMetrics

_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Endpoints whose requests we count; anything else is "other" (keeps label cardinality low).
COUNTED_ENDPOINTS = frozenset(
    {
        "/v1/infer", "/v1/models", "/v1/embeddings", "/v1/rerank", "/v1/completions",
        "/v1/chat/completions", "/embed_sparse", "/v2/rerank", "/v2/embed", "/tokenize",
        "/detokenize",
    }
)  # fmt: skip
V2_INFER = "/v2/models/{name}/infer"
REJECTION_REASON = {
    "overloaded": "queue_full",
    "draining": "draining",
    "not_ready": "not_ready",
    "payload_too_large": "too_large",
    "too_many_inputs": "too_large",
    "input_too_long": "too_large",
    "invalid_json": "invalid",
    "invalid_request": "invalid",
    "empty_input": "invalid",
    "unsupported_media_type": "invalid",
    "deadline_exceeded": "deadline",
    "unauthorized": "unauthorized",
}


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, as the access log and the status page see it."""

    request_id: str
    method: str
    path: str
    endpoint: str
    """``path`` for the counted endpoints, the v2 infer template, else ``other``."""
    status: int
    error_type: str
    duration_s: float
    trace: Any
    """The ``RequestTrace`` of a request that reached the runtime, else None."""


RequestObserver = Callable[[RequestRecord], None]


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class RequestContextMiddleware:
    """Assigns the request id, enforces ``max_body_bytes`` while streaming, counts requests."""

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int, metrics: ServerMetrics,
        observers: Sequence[RequestObserver] = (),
    ) -> None:  # fmt: skip
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.observers = tuple(observers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = _request_id(headers.get(b"x-request-id"))
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        path = scope["path"]
        endpoint = path if path in COUNTED_ENDPOINTS else _v2_endpoint(path)
        started = time.perf_counter()
        status = 500

        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            state["error_type"] = "payload_too_large"
            status = 413
            await _send_json(send, 413, request_id, BodyTooLarge(self.max_body_bytes).detail)
            self._record(scope, endpoint, status, state, started)
            return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                sent = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                trace = state.get("trace")
                # Set once the runtime has answered every input: not on errors, nor on a
                # generation request (whose answer starts before its tokens are generated).
                if trace is not None and trace.answered_s is not None and status < 400:
                    sent += trace.timing_headers()
                message["headers"] = sent
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, limited_receive, send_with_id)
        finally:
            self.metrics.in_flight.dec()
            self._record(scope, endpoint, status, state, started)

    def _record(
        self, scope: Scope, endpoint: str, status: int, state: dict[str, Any], started: float
    ) -> None:
        duration_s = time.perf_counter() - started
        error_type = state.get("error_type", "") if status >= 400 else ""
        self.metrics.count_request(endpoint, status, error_type)
        if self.observers:
            record = RequestRecord(
                request_id=state["request_id"], method=scope.get("method", ""),
                path=scope["path"], endpoint=endpoint, status=status, error_type=error_type,
                duration_s=duration_s, trace=state.get("trace"),
            )  # fmt: skip
            for observe in self.observers:
                observe(record)
        if endpoint == "other":
            return
        self.metrics.observe_duration(endpoint, state.get("model", ""), duration_s)
        reason = REJECTION_REASON.get(error_type)
        if reason is not None:
            self.metrics.count_rejection(reason)


def _v2_endpoint(path: str) -> str:
    """One label for every model's v2 infer path, so cardinality stays low."""
    return V2_INFER if path.startswith("/v2/models/") and path.endswith("/infer") else "other"


class RequestIds:
    """32 hex digits: a random 64-bit prefix drawn once per process, then a counter. Unique
    across replicas and restarts like a uuid4 (which costs a system call for 16 random bytes
    on every request), and cheap."""

    def __init__(self) -> None:
        self._pid = -1
        self._prefix = ""
        self._counter = itertools.count()

    def next(self) -> str:
        pid = os.getpid()
        if pid != self._pid:  # a forked child draws its own prefix
            self._pid, self._prefix = pid, os.urandom(8).hex()
            self._counter = itertools.count()
        return f"{self._prefix}{next(self._counter):016x}"


_ids = RequestIds()


def _request_id(header: bytes | None) -> str:
    if header:
        candidate = header.decode("latin-1")
        if _VALID_REQUEST_ID.fullmatch(candidate):
            return candidate
    return _ids.next()


async def _send_json(send: Send, status: int, request_id: str, message: str) -> None:
    body = error_body("payload_too_large", message, request_id, status=status)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id.encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
