"""A replica over a scripted model, served by real uvicorn on a loopback socket in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from prometheus_client import CollectorRegistry

from server import Settings, create_app
from server.one_write import OneWriteHTTPProtocol
from server.runtime.drain import DrainingServer
from tests.fakes import ScriptedModel
from tests.servers import free_port


@dataclass
class LiveServer:
    url: str
    port: int
    server: DrainingServer
    thread: threading.Thread
    registry: CollectorRegistry
    app: object

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})

    def wait_for(self, predicate, timeout_s: float = 10.0) -> None:
        """Poll until ``predicate()`` holds (a guard against hangs, not a proof of absence)."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not reached")
            time.sleep(0.005)


@contextlib.contextmanager
def serve_in_thread(model, *, models=None, **settings) -> Iterator[LiveServer]:
    """``model``, or several by name (``models``), served with ``settings``."""
    registry = CollectorRegistry()
    # A scripted model has no real memory to size batches by: a fixed budget, unless asked.
    resolved = Settings(**{"sizer": "fixed", **settings})
    app = create_app(resolved, model=model, models=models, registry=registry)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on",
        http=OneWriteHTTPProtocol,  # as server/cli.py serves
    )  # fmt: skip
    runtime = app.state.runtime
    server = DrainingServer(
        config, drain=lambda: runtime.drain(resolved.drain_timeout_s), abort=runtime.abort
    )
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", port, server, thread, registry, app)
    try:
        live.wait_for(lambda: server.started and runtime.ready, timeout_s=30)
        yield live
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "uvicorn did not stop"


@contextlib.contextmanager
def gated(**settings: object) -> Iterator[tuple[LiveServer, ScriptedModel, threading.Event]]:
    """A live server whose model blocks every forward pass until the test opens the gate."""
    gate = threading.Event()
    gate.set()  # the warm-up batch runs freely
    model = ScriptedModel(gate=gate)
    with serve_in_thread(model, **settings) as live:
        gate.clear()
        model.entered.clear()
        try:
            yield live, model, gate
        finally:
            gate.set()


def codes(live: LiveServer) -> dict[str, float]:
    """Status codes the replica answered on /v1/infer, from its own request counter."""
    found: dict[str, float] = {}
    for metric in live.registry.collect():
        for sample in metric.samples:
            counted = sample.name == "batchfit_requests_total" and sample.value
            if counted and sample.labels["endpoint"] == "/v1/infer":
                code = sample.labels["code"]
                found[code] = found.get(code, 0) + sample.value
    return found
