"""Start real replicas (``python -m server serve``) under uvicorn on loopback ports."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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


NO_CACHE = ("--cache-bytes", "0", "--no-deduplicate")


def without_cache(flags: tuple[str, ...]) -> tuple[str, ...]:
    """Replicas of the tests compute every input (each test sends its texts again and counts
    batches, fills the queue with one text...) unless a test sets --cache-bytes itself, as
    the cache's own tests do."""
    if any(flag.startswith("--cache-bytes") for flag in flags):
        return flags
    return (*NO_CACHE, *flags)


@contextlib.contextmanager
def run_server(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None, ready_timeout_s: float = 180,
    preexec=None,
) -> Iterator[ServerProcess]:  # fmt: skip
    flags = without_cache(flags)
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


T = TypeVar("T")
LONG_INPUT = " ".join(["queue"] * 300)  # truncated to the bundled model's 256 tokens


def queue_depth(metrics_url: str) -> float:
    """``batchfit_queue_depth`` as scraped from ``metrics_url`` (``.../metrics``)."""
    scrape = httpx.get(metrics_url, timeout=10).text
    match = re.search(r"^batchfit_queue_depth (\S+)$", scrape, re.MULTILINE)
    assert match, "no batchfit_queue_depth in the scrape"
    return float(match.group(1))


@contextlib.contextmanager
def queue_held(url: str, capacity: int, *, metrics_url: str | None = None) -> Iterator[None]:
    """While inside, the replica's queue has held waiting items since the moment it was
    entered: a request of ``capacity`` long inputs runs in the background (its batches take
    seconds), and ``batchfit_queue_depth`` was seen above 0. A request of ``capacity`` inputs
    sent then can only be refused as a full queue (429)."""
    with ThreadPoolExecutor(1) as pool:
        background = pool.submit(
            httpx.post, f"{url}/v1/infer", timeout=300,
            json={"inputs": [f"{i} {LONG_INPUT}" for i in range(capacity)], "timeout_s": 300},
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while queue_depth(metrics_url or f"{url}/metrics") < 1:
            assert not background.done(), background.result().text
            assert time.monotonic() < deadline, "the held request never reached the queue"
            time.sleep(0.005)
        try:
            yield
        finally:
            assert background.result().status_code == 200, background.result().text


def when_queue_full(
    url: str, capacity: int, send: Callable[[], T], status: Callable[[T], int],
    *, metrics_url: str | None = None, tries: int = 3,
) -> T:  # fmt: skip
    """``send()``'s answer while ``queue_held``: the first that is a 429. A host slowed down
    enough may drain the queue before the request arrives, so up to ``tries`` holds."""
    answers: list[Any] = []
    for _ in range(tries):
        with queue_held(url, capacity, metrics_url=metrics_url):
            answer = send()
        if status(answer) == 429:
            return answer
        answers.append(answer)
    raise AssertionError(f"no 429 while the queue was held: {answers}")
