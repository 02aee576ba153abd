"""Start one replica (``python -m server serve``) on a loopback port, watch it, stop it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` field of /proc/<pid>/status (VmRSS, VmHWM) in bytes; None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class Replica:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def rss_bytes(self) -> int | None:
        return read_status_bytes(self.process.pid, "VmRSS")

    def peak_rss_bytes(self) -> int | None:
        return read_status_bytes(self.process.pid, "VmHWM")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the replica process so far, with its API processes'
        (``--api-workers``: its children) while they run."""
        total = process_cpu_seconds(self.process.pid)
        if total is None:
            return None
        children = child_pids(self.process.pid)
        return total + sum(process_cpu_seconds(pid) or 0.0 for pid in children)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_ready(replica: Replica, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if replica.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {replica.process.returncode}:\n{replica.log()[-4000:]}"
                )
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{replica.url}/health/ready").status_code == 200:
                    return
            time.sleep(0.1)
    raise TimeoutError(f"server not ready after {timeout_s}s:\n{replica.log()[-4000:]}")


def die_with_parent() -> None:
    """In the child: get SIGTERM when the benchmark dies, even by SIGKILL (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


NO_CACHE = ("--cache-bytes", "0", "--no-deduplicate")
"""The benchmarks send the same requests at every load level (and wrk one body over and over):
they measure computing inputs, so their replicas compute every input, unless the flags set
--cache-bytes themselves (``bench/repeated.py`` measures the cache)."""


def launch_replica(flags: list[str], *, log_dir: Path | None = None) -> Replica:
    """Start a replica with ``flags`` on a free loopback port; it is not ready yet."""
    if not any(flag.startswith("--cache-bytes") for flag in flags):
        flags = [*NO_CACHE, *flags]
    return _launch(["-m", "server", "serve", "--log-level", "warning", *flags], log_dir)


def launch_baseline(factory: str, *, log_dir: Path | None = None) -> Replica:
    """Start plain uvicorn (its defaults, one worker) serving the app ``factory`` returns
    (``module:function``); it is not ready yet."""
    flags = ["--factory", factory, "--log-level", "warning", "--no-access-log"]
    return _launch(["-m", "uvicorn", *flags], log_dir)


def _launch(arguments: list[str], log_dir: Path | None) -> Replica:
    port = free_port()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="batchfit-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{port}.log"
    command = [sys.executable, *arguments, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=ROOT if (ROOT / "server").is_dir() else None,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
    return Replica(f"http://127.0.0.1:{port}", process, log_path)


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM (a replica drains), then SIGKILL if it outlasts ``timeout_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def stop_replica(replica: Replica) -> None:
    stop_process(replica.process)


@contextlib.contextmanager
def start_replicas(
    flag_lists: list[list[str]],
    *,
    log_dir: Path | None = None,
    ready_timeout_s: float = 180,
    baseline: str | None = None,
) -> Iterator[list[Replica]]:
    """Replicas started together (their start-ups overlap) and stopped with SIGTERM on exit.

    Without ``log_dir`` their logs go to a new temporary folder, removed at exit unless
    something failed (then it is kept for the post-mortem, and the error names it). With
    ``baseline`` (an app factory), one plain uvicorn serving it instead, ``flag_lists`` unused."""
    own_dir = log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix="batchfit-bench-")) if log_dir is None else log_dir
    replicas: list[Replica] = []
    failed = False
    try:
        if baseline is not None:
            replicas.append(launch_baseline(baseline, log_dir=log_dir))
        for flags in flag_lists if baseline is None else []:
            replicas.append(launch_replica(flags, log_dir=log_dir))
        for replica in replicas:
            wait_ready(replica, ready_timeout_s)
        yield replicas
    except BaseException:
        failed = True
        raise
    finally:
        for replica in replicas:
            stop_replica(replica)
        if own_dir and not failed:
            shutil.rmtree(log_dir, ignore_errors=True)


@contextlib.contextmanager
def start_replica(
    flags: list[str], *, log_dir: Path | None = None, ready_timeout_s: float = 180
) -> Iterator[Replica]:
    with start_replicas([flags], log_dir=log_dir, ready_timeout_s=ready_timeout_s) as replicas:
        yield replicas[0]


@contextlib.contextmanager
def start_baseline(
    factory: str, *, log_dir: Path | None = None, ready_timeout_s: float = 180
) -> Iterator[Replica]:
    """One plain uvicorn serving ``factory``'s app (``bench.baselines``), stopped at exit."""
    with start_replicas(
        [], log_dir=log_dir, ready_timeout_s=ready_timeout_s, baseline=factory
    ) as replicas:
        yield replicas[0]


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started that still run (none where it has exited)."""
    try:
        listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(child) for child in listed]
    except (OSError, ValueError):
        return []


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` so far, every thread (None once gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
