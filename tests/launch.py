"""Drive ``batchfit up`` as a real subprocess, and run a real Nginx from the same template."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from server.supervise.nginx import NginxConfig, check_config, nginx_command, prepare_prefix, render
from tests.ci import unavailable
from tests.servers import ROOT, free_port, without_cache

_REPLICA_LINE = re.compile(
    r"^(replica-\d+): (http://\S+) pid (\d+) metrics (http://\S+) ", re.MULTILINE
)
_NGINX_LINE = re.compile(r"^nginx: pid (\d+) ", re.MULTILINE)


@dataclass
class Launch:
    """A running ``batchfit up``."""

    url: str
    process: subprocess.Popen
    workdir: Path
    output_path: Path
    errors_path: Path
    replicas: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (url, pid)
    metrics_urls: dict[str, str] = field(default_factory=dict)
    nginx_pid: int = 0

    @property
    def access_log_path(self) -> Path:
        return self.workdir / "logs" / "access.log"

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def errors(self) -> str:
        return self.errors_path.read_text(errors="replace")

    def child_pids(self) -> list[int]:
        return [pid for _, pid in self.replicas.values()] + [self.nginx_pid]

    def address(self, name: str) -> str:
        return self.replicas[name][0].removeprefix("http://")


def wait_for_output(
    launch: Launch, pattern: str, timeout_s: float, *, errors: bool = False
) -> re.Match:
    """The first match of ``pattern`` in what ``batchfit up`` wrote to stdout (``errors``:
    to stderr, where its log goes), once there."""
    read = launch.errors if errors else launch.output
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, read(), re.MULTILINE)
        if match:
            return match
        if launch.process.poll() is not None:
            raise RuntimeError(
                f"batchfit up exited with {launch.process.returncode}:\n"
                f"{launch.output()}\n{launch.errors()}"
            )
        time.sleep(0.2)
    raise TimeoutError(f"no {pattern!r} from batchfit up:\n{launch.output()}\n{launch.errors()}")


def require_nginx() -> str:
    """Nginx's path; without it, fail in CI (``.ci/run`` installs it) and skip elsewhere."""
    path = shutil.which("nginx")
    if path is None:
        message = "nginx is not installed (apt-get install nginx, as .ci/run does)"
        unavailable(message)
    return path


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive loopback ports free now, below the ephemeral range
    (where ``free_port`` picks), for ``batchfit up --replica-ports``."""
    for start in range(20000, 32000, count):
        with contextlib.ExitStack() as stack:
            try:
                for port in range(start, start + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return start
    raise RuntimeError(f"no {count} consecutive free ports")


def start_launcher(tmp_path: Path, *flags: str, replicas: int) -> Launch:
    require_nginx()
    port = free_port()
    workdir = tmp_path / "up"
    output_path, errors_path = tmp_path / "up.out", tmp_path / "up.err"
    with open(output_path, "wb") as out, open(errors_path, "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "up", "--replicas", str(replicas),
             "--port", str(port), "--workdir", str(workdir), *without_cache(flags)],
            cwd=ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    return Launch(f"http://127.0.0.1:{port}", process, workdir, output_path, errors_path)


def wait_up(launch: Launch, timeout_s: float = 300) -> None:
    wait_for_output(launch, r"^batchfit up: http://", timeout_s)
    text = launch.output()
    found = _REPLICA_LINE.findall(text)
    launch.replicas = {name: (url, int(pid)) for name, url, pid, _ in found}
    launch.metrics_urls = {name: metrics for name, _, _, metrics in found}
    launch.nginx_pid = int(_NGINX_LINE.search(text).group(1))


def stop(launch: Launch, signum: int = signal.SIGTERM, timeout_s: float = 90) -> int:
    if launch.process.poll() is None:
        launch.process.send_signal(signum)
        try:
            launch.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            launch.process.kill()
            launch.process.wait(10)
    return launch.process.returncode


@contextlib.contextmanager
def run_launcher(tmp_path: Path, *flags: str, replicas: int) -> Iterator[Launch]:
    launch = start_launcher(tmp_path, *flags, replicas=replicas)
    try:
        wait_up(launch)
        yield launch
    finally:
        stop(launch)


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Nginx:
    url: str
    prefix: Path

    @property
    def access_log_path(self) -> Path:
        return self.prefix / "logs" / "access.log"

    def access_entries(self, expect: int = 1, timeout_s: float = 10) -> list[dict]:
        """The access log's lines, once at least ``expect`` are written (Nginx logs a request
        after it has answered it)."""
        import json

        deadline = time.monotonic() + timeout_s
        while True:
            lines = self.access_log_path.read_text().splitlines()
            if len(lines) >= expect or time.monotonic() > deadline:
                return [json.loads(line) for line in lines]
            time.sleep(0.05)


@contextlib.contextmanager
def run_nginx(
    tmp_path: Path, upstreams: Sequence[str], *, max_body_bytes: int = 2 * 2**20,
    read_timeout_s: int = 30, rate_limit_rps: int = 1000, rate_limit_burst: int = 1000,
    **options: int,
) -> Iterator[Nginx]:  # fmt: skip
    """A real Nginx from server/supervise/nginx.conf.template in front of ``upstreams``;
    ``options`` are more ``NginxConfig`` fields (``cache_bytes``...)."""
    nginx = require_nginx()
    port = free_port()
    prefix = tmp_path / f"nginx-{port}"
    config = NginxConfig(
        upstreams=upstreams, listen=f"127.0.0.1:{port}", max_body_bytes=max_body_bytes,
        read_timeout_s=read_timeout_s, rate_limit_rps=rate_limit_rps,
        rate_limit_burst=rate_limit_burst, prefix=prefix, **options,
    )  # fmt: skip
    conf = prepare_prefix(prefix, render(config))
    check_config(nginx, prefix, conf)
    process = subprocess.Popen(
        nginx_command(nginx, prefix, conf, "-g", "daemon off;"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((prefix / "logs" / "error.log").read_text())
            time.sleep(0.05)
        yield Nginx(f"http://127.0.0.1:{port}", prefix)
    finally:
        process.send_signal(signal.SIGQUIT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


class SilentUpstream:
    """A TCP server that accepts connections, reads, and never answers; counts connections."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone does not.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self.connections:
            conn.close()
        self._thread.join(5)


class UnreachableUpstream:
    """An address where a connection is never made: a listener that never accepts, its accept
    queue full, so the kernel drops every new SYN and a connect() times out (what Nginx meets
    at a container or pod address that has gone, or a replica whose accept queue is full)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._fillers: list[socket.socket] = []
        # The first connection fills the queue of a listen(0) socket; later SYNs are dropped.
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(self.sock.getsockname())
            self._fillers.append(filler)
        probe = socket.socket()
        probe.settimeout(0.5)
        try:
            probe.connect(self.sock.getsockname())
        except TimeoutError:
            pass
        else:
            raise RuntimeError("the full accept queue took a connection: SYNs are not dropped")
        finally:
            probe.close()

    def close(self) -> None:
        for filler in self._fillers:
            filler.close()
        self.sock.close()


class CutOffUpstream:
    """An HTTP/1.1 upstream that dies mid-answer: it reads a request, writes ``sent`` (nothing,
    or a response head that promises a body) and closes, as a replica SIGKILLed there would."""

    def __init__(self, sent: bytes) -> None:
        self.sent = sent
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                # The whole request is read first, so the close is a FIN, not a reset.
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                    data += chunk
                head, found, body = data.partition(b"\r\n\r\n")
                if not found:
                    continue  # closed before a whole request head
                length = re.search(rb"(?im)^content-length: *(\d+)", head)
                while length and len(body) < int(length.group(1)) and (chunk := conn.recv(65536)):
                    body += chunk
                self.requests += 1
                conn.sendall(self.sent)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


class StatusUpstream:
    """A minimal HTTP/1.1 upstream that answers every request with one fixed response."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        import http.server

        outer = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                outer.requests += 1
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                self.send_response(status)
                for name, value in {**headers, "content-length": str(len(body))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
