"""``wrk`` as a load generator: one fixed POST body, C connections, a fixed duration.

wrk is a C load generator (epoll, one thread here), so at a few thousand requests per second
its own CPU is a small share of what it measures, unlike a Python client. Its Lua ``done``
hook prints the figures as one JSON line, read back here.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

WRK = "wrk"

_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]

done = function(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '\\n{{"requests": %d, "duration_us": %d, "mean_us": %f, "p50_us": %d, "p99_us": %d, ' ..
    '"max_us": %d, "connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}}\\n',
    summary.requests, summary.duration, latency.mean, latency:percentile(50),
    latency:percentile(99), latency.max, errors.connect, errors.read, errors.write,
    errors.status, errors.timeout))
end
"""


@dataclass(frozen=True, slots=True)
class WrkResult:
    connections: int
    requests: int
    duration_s: float
    mean_s: float
    p50_s: float
    p99_s: float
    max_s: float
    errors: int
    """Transport errors, timeouts and non-2xx answers together."""

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def available() -> bool:
    return shutil.which(WRK) is not None


def lua_script(body: bytes) -> str:
    text = body.decode()
    if "]==]" in text:
        raise ValueError("the body may not contain ]==]")
    return _SCRIPT.format(body=text)


def parse_output(stdout: str, connections: int) -> WrkResult:
    """The JSON line the ``done`` hook printed."""
    lines = [line for line in stdout.splitlines() if line.startswith('{"requests"')]
    if not lines:
        raise RuntimeError(f"wrk printed no summary:\n{stdout[-2000:]}")
    f = json.loads(lines[-1])
    return WrkResult(
        connections=connections,
        requests=f["requests"],
        duration_s=f["duration_us"] / 1e6,
        mean_s=f["mean_us"] / 1e6,
        p50_s=f["p50_us"] / 1e6,
        p99_s=f["p99_us"] / 1e6,
        max_s=f["max_us"] / 1e6,
        errors=sum(f[k] for k in ("connect", "read", "write", "status", "timeout")),
    )


def run_wrk(
    url: str, body: bytes, *, connections: int, duration_s: float, threads: int = 1
) -> WrkResult:
    """POST ``body`` to ``url`` (the full address, path included) for ``duration_s``."""
    with tempfile.TemporaryDirectory(prefix="batchfit-wrk-") as folder:
        script = Path(folder) / "post.lua"
        script.write_text(lua_script(body))
        done = subprocess.run(
            [WRK, "-t", str(threads), "-c", str(connections), "-d", f"{duration_s:g}s",
             "--timeout", "10s", "-s", str(script), url],
            capture_output=True, text=True, timeout=duration_s + 60,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-2000:]}")
    return parse_output(done.stdout, connections)


def merge_runs(runs: list[WrkResult]) -> WrkResult:
    """Rounds of one level as one run: requests, time and errors summed, the mean weighted by
    requests, the slowest answer the slowest of all. wrk reports percentiles, not latencies,
    so p50 and p99 are the median round's."""
    if not runs or len({run.connections for run in runs}) != 1:
        raise ValueError("merge rounds of one level: one connection count, at least one run")
    requests = sum(run.requests for run in runs)
    return WrkResult(
        connections=runs[0].connections,
        requests=requests,
        duration_s=sum(run.duration_s for run in runs),
        mean_s=sum(run.mean_s * run.requests for run in runs) / requests if requests else 0.0,
        p50_s=statistics.median(run.p50_s for run in runs),
        p99_s=statistics.median(run.p99_s for run in runs),
        max_s=max(run.max_s for run in runs),
        errors=sum(run.errors for run in runs),
    )
