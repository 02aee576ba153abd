"""The servers compared, each started as a child process on a loopback port, waited for,
and stopped with its whole process group (vLLM starts an engine process of its own).

- ``naive``: ``bench.generate.naive`` (transformers ``generate``, one request at a time).
- ``vllm``: vLLM's OpenAI server from its own virtual environment (``vllm_env``).
- ``batchfit``: ``batchfit serve --task generate``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.servers import ROOT, die_with_parent, free_port

SERVER_PEERS = ("naive", "vllm", "batchfit")
PEERS = ("naive", "limit", "vllm", "batchfit")
VLLM_DTYPE = "float32"


class PeerError(RuntimeError):
    """A peer that could not start or serve; its message says why in a few lines."""


@dataclass(frozen=True, slots=True)
class Launch:
    """How to start one server: its command (``{port}`` filled in), environment additions
    and the path that answers 200 once it is ready."""

    name: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    ready_path: str
    ready_timeout_s: float


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    start_s: float = 0.0

    def log_tail(self, num_lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.strip().splitlines()[-num_lines:])


def naive_launch(folder: str) -> Launch:
    command = (sys.executable, "-m", "bench.generate.naive", "--model", folder,
               "--host", "127.0.0.1", "--port", "{port}")  # fmt: skip
    return Launch("naive", command, {}, "/health/ready", 300)


def batchfit_launch(model: str, extra_flags: Sequence[str] = ()) -> Launch:
    command = (sys.executable, "-m", "server", "serve", "--model", model, "--task", "generate",
               "--host", "127.0.0.1", "--port", "{port}", *extra_flags)  # fmt: skip
    return Launch("batchfit", command, {}, "/health/ready", 600)


def vllm_launch(
    venv: Path,
    folder: str,
    *,
    kv_cache_gib: float | None,
    max_num_seqs: int | None = None,
    all_cores: bool = False,
    kv_cache_bytes: int | None = None,
    max_model_len: int | None = None,
) -> Launch:
    """vLLM's defaults but for float32 (the weights every peer serves) and loopback; its CPU
    build wants ``VLLM_CPU_KVCACHE_SPACE`` (GiB) set, or it asks for most of the host's RAM
    (``kv_cache_gib`` None: that default; ``kv_cache_bytes``: a cache of that size).

    ``all_cores``: its compute threads bound to every core this process may use, none kept
    for its scheduler. By default it keeps one core per worker for the scheduler, which on a
    two-core host leaves its model one core."""
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", folder, "--host", "127.0.0.1", "--port", "{port}",
               "--dtype", VLLM_DTYPE]  # fmt: skip
    name = "vllm"
    if kv_cache_bytes is not None:  # finer than VLLM_CPU_KVCACHE_SPACE's whole GiB
        command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if max_model_len is not None:  # a small cache must hold one sequence of this length
        command += ["--max-model-len", str(max_model_len)]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
        name = f"vllm max_num_seqs={max_num_seqs}"
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    if kv_cache_gib is not None:  # None: its own default
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    if all_cores:
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        env |= {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        name = f"{name} all cores"
    return Launch(name, tuple(command), env, "/health", 900)


def _wait_ready(server: Server, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise PeerError(
                    f"{server.name} exited with {server.process.returncode} before it was "
                    f"ready; its log ends:\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{server.url}{path}").status_code == 200:
                    return
            time.sleep(0.25)
    raise PeerError(f"{server.name} not ready after {timeout_s:g} s:\n{server.log_tail()}")


def _stop(process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """SIGTERM to the server's process group, SIGKILL to it if it outlasts ``timeout_s``."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
    # Children (vLLM's engine) may outlive their parent: the group goes either way.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


def _preexec(then: Callable[[], None] | None) -> Callable[[], None] | None:
    def run() -> None:
        if sys.platform == "linux":
            die_with_parent()
        if then is not None:
            then()

    return run if then is not None or sys.platform == "linux" else None


@contextlib.contextmanager
def start_server(
    launch: Launch, log_dir: Path, *, preexec: Callable[[], None] | None = None
) -> Iterator[Server]:
    """The server running and ready (its start-up time in ``start_s``); stopped at exit.
    ``PeerError`` where it cannot start. ``preexec`` runs in the child before it starts (to
    join a cgroup)."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    slug = launch.name.replace(" ", "-").replace("=", "")
    log_path = log_dir / f"{slug}-{port}.log"
    command = [part.replace("{port}", str(port)) for part in launch.command]
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        try:
            process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, **launch.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_preexec(preexec),
            )
        except OSError as exc:
            raise PeerError(f"{launch.name} could not start: {exc}") from exc
    server = Server(launch.name, f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_ready(server, launch.ready_path, launch.ready_timeout_s)
        server.start_s = time.perf_counter() - started
        yield server
    finally:
        _stop(process)
