"""What ``batchfit up`` knows of the processes it owns (replicas, Nginx), and of its own stop:
each child's state, how it ended, when it restarts, whether it still answers."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import httpx

log = logging.getLogger("batchfit.launcher")
_PR_SET_PDEATHSIG = 1


class StopRequest:
    """Ctrl-C or SIGTERM, as the launcher's signal handler (``handle``) records it: a plain
    flag, set without a lock. ``threading.Event.set`` takes one, and a second signal that
    arrives while the first one's handler holds it (a wrapper such as ``timeout`` forwarding
    the signal it got to a launcher that got it too) deadlocks the main thread for good: 3 of
    120 pairs of signals sent 80-120 us apart did so here."""

    def __init__(self) -> None:
        self._requested = False

    def handle(self, signum: int, frame: object) -> None:
        self._requested = True

    def is_set(self) -> bool:
        return self._requested

    def wait(self, timeout_s: float) -> bool:
        """Sleep ``timeout_s`` unless a stop was asked for; return whether one was. (A signal
        does not cut the sleep short: its handler returns into it.)"""
        if not self._requested:
            time.sleep(timeout_s)
        return self._requested


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path
    url: str = ""
    metrics_url: str = ""
    argv: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    started_s: float = 0.0
    num_restarts: int = 0
    backoff_s: float = 0.0  # the wait before the next restart; 0 until the first death
    restart_at_s: float | None = None  # set while dead and waiting to be restarted
    ready: bool = False
    next_liveness_s: float = 0.0  # when /health/live is asked next (while ready)
    unanswered: int = 0  # /health/live questions in a row without a 200
    liveness: Future[str | None] | None = None  # the question in flight: its problem, if any
    readiness: Future[bool] | None = None  # while not ready: the question in flight

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def ask_live(url: str, timeout_s: float) -> str | None:
    """One liveness question: None if ``url`` answered 200 within ``timeout_s``, else what
    went wrong."""
    try:
        status = httpx.get(url, timeout=timeout_s).status_code
    except httpx.TimeoutException:
        return f"did not answer within {timeout_s:g}s"
    except httpx.TransportError as exc:
        return f"failed: {exc!r}"
    return None if status == 200 else f"answered {status}"


def ask_ready(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url`` (a replica's /health/ready) answered 200 within ``timeout_s``."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.TransportError:
        return False


def describe_exit(returncode: int | None) -> str:
    """``exited with 1`` or ``exited with -9 (killed by SIGKILL)``: what a supervisor logs."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = " (the kernel's OOM killer sends this one)" if returncode == -signal.SIGKILL else ""
        return f"exited with {returncode} (killed by {name}{why})"
    return f"exited with {returncode}"


def next_backoff(previous_s: float, uptime_s: float, *, first_s: float, max_s: float,
                 reset_after_s: float) -> float:  # fmt: skip
    """The wait before restarting a replica that just died after ``uptime_s`` up: the first
    wait again after a long healthy run, otherwise double the previous one, capped."""
    if previous_s <= 0 or uptime_s >= reset_after_s:
        return first_s
    return min(max_s, previous_s * 2)


def die_with_parent() -> None:
    # Linux: the child gets SIGTERM if the launcher dies without stopping it (e.g. SIGKILL).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_children(children: list[Child], signum: int, timeout_s: float) -> None:
    for child in children:
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signum)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %ss; killing it", child.name, timeout_s)
            child.process.kill()
            child.process.wait()
