"""``/metrics`` on a port of its own (``--metrics-port``), served from the replica's event loop.

A second, small uvicorn server in the same process: Prometheus scrapes each replica there
directly, and the public port (behind Nginx) no longer answers ``/metrics`` at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator

import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_body

log = logging.getLogger("batchfit")

METRICS_PATH = "/metrics"
TASK_NAME = "batchfit-metrics-server"


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


def metrics_app(registry: CollectorRegistry) -> ASGIApp:
    """``GET /metrics`` from ``registry``; any other path is 404 in our error shape."""
    exposition = make_asgi_app(registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == METRICS_PATH:
            await exposition(scope, receive, send)
            return
        body = error_body("not_found", "only /metrics is served here", "", status=404)
        await send(
            {
                "type": "http.response.start",
                "status": 404,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def bind(host: str, port: int) -> socket.socket:
    """Bind now, so a port in use fails start-up with a clear ``OSError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


@contextlib.asynccontextmanager
async def serve_metrics(
    registry: CollectorRegistry, *, host: str, port: int
) -> AsyncIterator[None]:
    """Serve ``registry`` on ``host:port`` for the duration of the block."""
    sock = bind(host, port)
    config = uvicorn.Config(
        metrics_app(registry),
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
