"""``/metrics`` on a port of its own (``--metrics-port``), served from the replica's event loop.

A second, small uvicorn server in the same process: Prometheus scrapes each replica there
directly, and the public port (behind Nginx) no longer answers ``/metrics`` at all. With
``--api-workers``, the engine process serves it: the replica's series, merged from every
process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, make_asgi_app
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_body

log = logging.getLogger("batchfit")

METRICS_PATH = "/metrics"
TASK_NAME = "batchfit-metrics-server"

Exposition = Callable[[], Awaitable[bytes]]
"""The replica's series in the text format, gathered on each scrape (an engine's, merged)."""


class _MetricsServer(uvicorn.Server):
    """Leaves SIGTERM and SIGINT to the main server: this one stops when the app stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _QuietTask(logging.Filter):
    """Drops uvicorn's INFO lines ("Started server process", "Shutting down") that come from
    the metrics server's task, so the log shows them once, for the main server."""

    def __init__(self, task_name: str) -> None:
        super().__init__()
        self.task_name = task_name

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop: another thread
            return True
        return task is None or task.get_name() != self.task_name


def metrics_app(source: CollectorRegistry | Exposition) -> ASGIApp:
    """``GET /metrics`` from ``source`` (a registry, or a call that gathers the series); any
    other path is 404 in our error shape."""
    exposition = (
        make_asgi_app(source) if isinstance(source, CollectorRegistry) else _gathered(source)
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == METRICS_PATH:
            await exposition(scope, receive, send)
            return
        body = error_body("not_found", "only /metrics is served here", "", status=404)
        await _answer(send, 404, b"application/json", body)

    return app


def _gathered(gather: Exposition) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await _answer(send, 200, CONTENT_TYPE_LATEST.encode(), await gather())

    return app


async def _answer(send: Send, status: int, content_type: bytes, body: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def bind(host: str, port: int) -> socket.socket:
    """Bind now, so a port in use fails start-up with a clear ``OSError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


@contextlib.asynccontextmanager
async def serve_metrics(
    source: CollectorRegistry | Exposition, *, host: str, port: int
) -> AsyncIterator[None]:
    """Serve ``source``'s series on ``host:port`` for the duration of the block."""
    sock = bind(host, port)
    config = uvicorn.Config(
        metrics_app(source),
        lifespan="off",
        access_log=False,
        log_config=None,  # leave the process's logging as the main server configured it
        log_level=None,
    )
    server = _MetricsServer(config)
    quiet = _QuietTask(TASK_NAME)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=TASK_NAME)
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            task.result()  # raises what stopped it
        log.info("metrics on http://%s:%d%s", host, port, METRICS_PATH)
        yield
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
        uvicorn_log.removeFilter(quiet)
