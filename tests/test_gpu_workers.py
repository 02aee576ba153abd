"""The GPU check's load from several client processes (scripts/gpu_workers.py), against a
plain HTTP server on loopback."""

from __future__ import annotations

import http.server
import multiprocessing
import threading
import time
from dataclasses import dataclass

import pytest

from scripts.gpu_workers import aiohttp_load

CLIENT_PORTS: set[int] = set()
"""The client ports the server was asked from: one per keep-alive connection."""


class Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        CLIENT_PORTS.add(self.client_address[1])
        body = b'{"outputs": [[0.0]]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class FakeReplica:
    url: str

    def cpu_seconds(self) -> float:
        return 1.0


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield FakeReplica(f"http://127.0.0.1:{httpd.server_address[1]}")
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.timeout(120)
def test_the_connections_are_shared_among_the_processes_and_every_outcome_comes_back(server):
    CLIENT_PORTS.clear()
    children: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            children.update(child.pid for child in multiprocessing.active_children())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outcomes, wall_s, cpu_s = aiohttp_load(server, 5, 0.2, 0.5, 2)
    finally:
        done.set()
        watcher.join()
    assert len(children) == 2
    assert outcomes and all(o.status == 200 for o in outcomes)
    assert 0.5 <= wall_s < 5 and cpu_s == 0.0
    # 3 + 2 connections, each one keep-alive socket, in the warm-up and again when counted.
    assert len(CLIENT_PORTS) == 10
