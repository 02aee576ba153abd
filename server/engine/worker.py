"""One API process (``python -m server.engine.worker``, started by the engine only).

Its stdin brings the settings, its end of the socket pair to the engine, the listening
socket's descriptor and its index, and stays open: when it closes, the engine is gone. It
serves the same app as a single-process replica, on the shared socket, with a
``RemoteRuntime`` in place of the runtime. Signals are the engine's to handle: the engine
tells it when to stop.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn
from prometheus_client import CollectorRegistry

from ..app import create_app
from ..logs import configure_logging
from ..one_write import OneWriteHTTPProtocol
from ..supervise.nginx import UVICORN_KEEP_ALIVE_S
from .remote import RemoteRuntime

HANDSHAKE_TIMEOUT_S = 30.0


class WorkerServer(uvicorn.Server):
    """Leaves SIGTERM and SIGINT to the engine, which drains the replica and says when;
    listens once the engine has said whether it is ready."""

    def __init__(self, config: uvicorn.Config, runtime: RemoteRuntime) -> None:
        super().__init__(config)
        self._runtime = runtime

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # NOTE: uvicorn runs the lifespan's start-up (which connects to the engine) and
        # then listens, within this one method; the wait goes between the two.
        lifespan_startup = self.lifespan.startup

        async def start_then_hear() -> None:
            await lifespan_startup()
            await self._runtime.heard_from_engine(HANDSHAKE_TIMEOUT_S)

        self.lifespan.startup = start_then_hear  # type: ignore[method-assign]
        await super().startup(sockets)


def main() -> int:
    # What the engine sends may name a `python:` model's own module, importable from the
    # working directory as it is in the engine (models/custom.py). Started with -P, so that a
    # folder there named like one of our packages cannot hide it, this process puts the
    # directory at the end of the path, once our packages are imported.
    sys.path.append(os.getcwd())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    # NOTE: one pickle and no more: what is left of stdin is read only to see it close.
    settings, link_fd, fd, index = pickle.load(stdin)
    configure_logging(settings.log_level)
    listener = socket.socket(fileno=fd)
    exit_code = 0

    def on_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = max(exit_code, code)
        server.should_exit = True

    registry = CollectorRegistry()
    runtime = RemoteRuntime(
        settings, registry=registry, link_fd=link_fd, index=index,
        stdin_fd=stdin.fileno(), on_exit=on_exit,
    )  # fmt: skip
    app = create_app(settings, runtime=runtime, registry=registry, watch_loop=True)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        http=OneWriteHTTPProtocol,
        log_config=None,
        access_log=False,
        timeout_keep_alive=UVICORN_KEEP_ALIVE_S,
        # As a single-process replica's (server/cli.py): only answers being written are left.
        timeout_graceful_shutdown=2,
        lifespan="on",
    )
    server = WorkerServer(config, runtime)
    server.run(sockets=[listener])
    return exit_code


if __name__ == "__main__":
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    sys.exit(main())
