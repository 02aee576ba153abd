"""Start real replicas (``python -m server serve``) under uvicorn on loopback ports."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.servers import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ServerProcess:
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path
    ready_answers: list[int] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_ready(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {server.process.returncode}:\n{server.log()}"
                )
            try:
                status = client.get(f"{server.url}/health/ready").status_code
            except httpx.TransportError:
                status = 0
            server.ready_answers.append(status)
            if status == 200:
                return
            time.sleep(0.1)
    raise TimeoutError(f"server not ready after {timeout_s}s:\n{server.log()}")


@contextlib.contextmanager
def run_server(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None, ready_timeout_s: float = 180,
    preexec=None,
) -> Iterator[ServerProcess]:  # fmt: skip
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
             *flags],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, preexec_fn=preexec,
        )  # fmt: skip
    server = ServerProcess(f"http://127.0.0.1:{port}", port, process, log_path)
    try:
        wait_ready(server, ready_timeout_s)
        yield server
    finally:
        stop_process(process)
