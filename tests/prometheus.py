"""Start a real Prometheus (Debian's ``prometheus`` package) on a loopback port, and query it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.servers import stop_process
from tests.ci import unavailable
from tests.servers import ROOT, free_port

SHIPPED_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def require(binary: str) -> str:
    """The binary's path; without it, fail in CI (``.ci/run`` installs it) and skip elsewhere."""
    path = shutil.which(binary)
    if path is None:
        message = f"{binary} is not installed (apt-get install prometheus, as .ci/run does)"
        unavailable(message)
    return path


@dataclass
class PrometheusProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def query(self, expr: str) -> dict[str, Any]:
        """The JSON answer of an instant query (``status``, ``data`` or ``error``)."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        return response.json()


def scrape_config(targets: Sequence[str], *, scrape_interval_s: float) -> str:
    listed = ", ".join(f'"{t}"' for t in targets)
    return (
        "global:\n"
        f"  scrape_interval: {scrape_interval_s}s\n"
        f"  evaluation_interval: {scrape_interval_s}s\n"
        "scrape_configs:\n"
        "  - job_name: batchfit\n"
        "    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: [{listed}]\n"
    )


@contextlib.contextmanager
def run_prometheus(
    tmp_path: Path, targets: Sequence[str], *, scrape_interval_s: float = 1.0,
    ready_timeout_s: float = 60,
) -> Iterator[PrometheusProcess]:  # fmt: skip
    binary = require("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(scrape_config(targets, scrape_interval_s=scrape_interval_s))
    data = tmp_path / "prometheus-data"
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    prometheus = PrometheusProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_ready(prometheus, ready_timeout_s)
        yield prometheus
    finally:
        stop_process(process)


def _wait_ready(prometheus: PrometheusProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if prometheus.process.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{prometheus.log()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{prometheus.url}/-/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"prometheus not ready after {timeout_s}s:\n{prometheus.log()}")
