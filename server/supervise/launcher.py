"""``batchfit up``: N replicas on loopback ports and a real Nginx in front of them.

The launcher owns every process it starts: replicas and Nginx run in their own sessions (a
terminal's Ctrl-C reaches only the launcher, which then stops them in order: Nginx first, then
the replicas, each given ``stop_timeout_s``), and they get SIGTERM if the launcher itself dies.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import httpx
from pydantic import ValidationError

from ..openmp import OPERATOR_SPINCOUNT
from ..runtime.threads import host_capacity
from ..settings import LauncherSettings, Settings
from .children import (
    Child,
    StopRequest,
    ask_live,
    ask_ready,
    describe_exit,
    die_with_parent,
    next_backoff,
    stop_children,
)
from .nginx import (
    NginxConfig,
    check_config,
    generation_read_timeout_for,
    nginx_command,
    prepare_prefix,
    read_timeout_for,
    render,
)

log = logging.getLogger("batchfit.launcher")
# The launcher picks each replica's addresses itself (a free loopback port for HTTP and one
# for /metrics, so N replicas never collide and metrics stay off the Nginx path).
REPLICA_ADDRESS_FIELDS = frozenset({"host", "port", "metrics_port"})
POLL_S = 0.2


class LaunchFailed(Exception):
    pass


def up(args: argparse.Namespace) -> int:
    """Entry point of ``batchfit up`` (after argument parsing)."""
    given = vars(args)
    try:
        launcher = LauncherSettings(
            **{k: v for k, v in given.items() if k in LauncherSettings.model_fields}
        )
        replica_flags = {
            k: v
            for k, v in given.items()
            if k in Settings.model_fields and k not in REPLICA_ADDRESS_FIELDS
        }
        replica = Settings(**replica_flags)
    except ValidationError as exc:
        print(f"batchfit: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=replica.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # One line per readiness poll is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return Launcher(launcher, replica, passthrough_argv(replica_flags)).run()


def passthrough_argv(flags: dict[str, object]) -> list[str]:
    """The serve flags given to ``up``, as flags for each replica's ``serve``."""
    argv = []
    for name, value in flags.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, list | tuple):
            for item in value:
                argv += [f"--{flag}", str(item)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv


SHARED_SPINCOUNT = "1000"
"""OpenMP's spin for replicas that share a host's cores (docs/cpu.md)."""


def replica_environment(num_replicas: int, cores: int | None = None) -> dict[str, str]:
    """The launcher's environment, with the CPU cores shared out among the replicas: N replicas
    on one machine each using every core oversubscribe it (measured here: several times slower).
    The cores are those the launcher may use, its cgroup's CPU quota included; each replica
    reads OMP_NUM_THREADS as its thread count. An OMP_NUM_THREADS already set wins. A count
    set from outside keeps its threads however busy the host is, so OpenMP's workers spin only
    briefly (``SHARED_SPINCOUNT``), unless GOMP_SPINCOUNT is set."""
    env = dict(os.environ)
    if cores is None:
        cores = host_capacity().num_threads
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // num_replicas)))
    env["GOMP_SPINCOUNT"] = OPERATOR_SPINCOUNT or SHARED_SPINCOUNT
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def replica_ports(settings: LauncherSettings) -> list[tuple[int, int]]:
    """Each replica's (HTTP, metrics) port: consecutive from ``--replica-ports``, else free
    ones picked now."""
    count = settings.replicas
    if settings.replica_ports is None:
        return [(free_port(), free_port()) for _ in range(count)]
    start = settings.replica_ports
    return [(start + index, start + count + index) for index in range(count)]


def ports_in_use(ports: list[int], host: str = "127.0.0.1") -> list[int]:
    """Those of ``ports`` something already listens on (or that cannot be bound)."""
    taken = []
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                taken.append(port)
    return taken


class Launcher:
    def __init__(self, settings: LauncherSettings, replica: Settings, replica_argv: list[str],
                 out: IO[str] | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.replica = replica
        self.replica_argv = replica_argv
        self.out = out or sys.stdout
        self.replicas: list[Child] = []
        self.nginx: Child | None = None
        self.stop_requested = StopRequest()
        # A hung replica answers /health/live only at the timeout: asked here, it would hold
        # the loop that sees the others die, and Ctrl-C, that long.
        self._questions = ThreadPoolExecutor(thread_name_prefix="batchfit-liveness")

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self.stop_requested.handle)
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        workdir = self.settings.workdir
        temporary = workdir is None
        prefix = Path(tempfile.mkdtemp(prefix="batchfit-up-")) if temporary else Path(workdir)
        prefix = prefix.resolve()
        prefix.mkdir(parents=True, exist_ok=True)
        self._say(f"batchfit up: config and logs in {prefix}")
        try:
            self._start(prefix)
            self._say(f"batchfit up: http://{self._public_host()}:{self.settings.port} "
                      f"({len(self.replicas)} replicas behind nginx; Ctrl-C stops)")  # fmt: skip
            return self._supervise()
        except LaunchFailed as exc:
            log.error("%s", exc)
            return 1
        finally:
            self._questions.shutdown(wait=False, cancel_futures=True)
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._report_stop(prefix, remove=temporary and not self.settings.keep_logs)

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _public_host(self) -> str:
        host = self.settings.host
        return "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host

    def _spawn(
        self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
        *, append: bool = False,
    ) -> subprocess.Popen:  # fmt: skip
        with open(log_path, "ab" if append else "wb") as log_file:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent, env=env,
            )  # fmt: skip

    def _start(self, prefix: Path) -> None:
        if shutil.which(self.settings.nginx) is None:
            raise LaunchFailed(
                f"no {self.settings.nginx!r} binary found: install Nginx (Debian: apt-get "
                "install nginx) or pass --nginx PATH"
            )
        ports = replica_ports(self.settings)
        if self.settings.replica_ports is not None:
            taken = ports_in_use([port for pair in ports for port in pair])
            if taken:
                raise LaunchFailed(
                    f"--replica-ports: port(s) {', '.join(map(str, taken))} on 127.0.0.1 are "
                    "already in use; choose another START"
                )
        # Replicas load their models in parallel; Nginx starts once all of them are ready.
        env = replica_environment(self.settings.replicas)
        for index, (port, metrics_port) in enumerate(ports):
            log_path = prefix / f"replica-{index}.log"
            # -P: a folder named like one of our packages where this runs must not hide it.
            argv = (sys.executable, "-P", "-m", "server", "serve", "--host", "127.0.0.1",
                    "--port", str(port), "--metrics-port", str(metrics_port),
                    *self.replica_argv)  # fmt: skip
            child = Child(
                f"replica-{index}", self._spawn(list(argv), log_path, env), log_path,
                url=f"http://127.0.0.1:{port}",
                metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
                argv=argv, env=env, started_s=time.monotonic(),
            )  # fmt: skip
            self.replicas.append(child)
            self._say(f"{child.name}: {child.url} pid {child.process.pid} "
                      f"metrics {child.metrics_url} log {log_path}")  # fmt: skip
        self._wait_ready()

        config = NginxConfig(
            upstreams=[child.url.removeprefix("http://") for child in self.replicas],
            listen=f"{self._listen_host()}:{self.settings.port}",
            max_body_bytes=self.replica.max_body_bytes,
            read_timeout_s=read_timeout_for(self.replica.max_timeout_s),
            rate_limit_rps=self.settings.rate_limit_rps,
            rate_limit_burst=self.settings.rate_limit_burst,
            prefix=prefix,
            cache_bytes=int(self.settings.nginx_cache_bytes),
            cache_valid_s=self.settings.nginx_cache_valid_s,
            generation_read_timeout_s=generation_read_timeout_for(
                self.settings.generation_read_timeout_s, self.replica.max_timeout_s
            ),
        )
        conf = prepare_prefix(prefix, render(config))
        try:
            check_config(self.settings.nginx, prefix, conf)
        except (OSError, RuntimeError) as exc:
            raise LaunchFailed(f"nginx: {exc}") from exc
        # In the foreground (daemon off), so the launcher owns its lifetime.
        argv = nginx_command(self.settings.nginx, prefix, conf, "-g", "daemon off;")
        process = self._spawn(argv, prefix / "logs" / "nginx.out")
        self.nginx = Child("nginx", process, prefix / "logs" / "error.log")
        self._wait_nginx()
        self._say(f"nginx: pid {process.pid} config {conf} "
                  f"access log {prefix / 'logs' / 'access.log'}")  # fmt: skip

    def _listen_host(self) -> str:
        host = self.settings.host
        return f"[{host}]" if ":" in host else host

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        waiting = list(self.replicas)
        with httpx.Client(timeout=2) as client:
            while waiting:
                if self.stop_requested.is_set():
                    raise LaunchFailed("stopped while the replicas were starting")
                for child in list(waiting):
                    if not child.alive():
                        raise LaunchFailed(
                            f"{child.name} exited with {child.process.returncode}:\n"
                            f"{child.log_tail()}"
                        )
                    with contextlib.suppress(httpx.TransportError):
                        if client.get(f"{child.url}/health/ready").status_code == 200:
                            waiting.remove(child)
                            child.ready = True
                            self._say(f"{child.name}: ready")
                if waiting and time.monotonic() > deadline:
                    names = ", ".join(child.name for child in waiting)
                    raise LaunchFailed(f"not ready after {self.settings.ready_timeout_s}s: {names}")
                if waiting:
                    self.stop_requested.wait(POLL_S)

    def _wait_nginx(self) -> None:
        assert self.nginx is not None
        url = f"http://{self._public_host()}:{self.settings.port}/v1/models"
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=2) as client:
            while True:
                if not self.nginx.alive():
                    raise LaunchFailed(
                        f"nginx exited with {self.nginx.process.returncode}:\n"
                        f"{self.nginx.log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(url).status_code == 200:
                        return
                if time.monotonic() > deadline or self.stop_requested.is_set():
                    raise LaunchFailed(f"nginx does not answer on {url}")
                self.stop_requested.wait(POLL_S)

    def _supervise(self) -> int:
        """Wait for Ctrl-C/SIGTERM. A dead replica is reported and restarted with backoff
        (Nginx routes around it meanwhile); a dead Nginx ends the launch."""
        assert self.nginx is not None
        while not self.stop_requested.wait(POLL_S):
            if not self.nginx.alive():
                log.error("nginx exited with %s:\n%s", self.nginx.process.returncode,
                          self.nginx.log_tail())  # fmt: skip
                return 1
            for child in self.replicas:
                self._watch(child)
        self._say("batchfit up: stopping")
        return 0

    def _watch(self, child: Child) -> None:
        now = time.monotonic()
        if child.alive():
            if not child.ready:
                self._check_ready(child)
            else:
                self._check_liveness(child, now)
            return
        if child.restart_at_s is not None:
            if now >= child.restart_at_s:
                self._restart(child)
            return
        # Just found dead.
        child.ready = False
        child.unanswered, child.next_liveness_s, child.liveness = 0, 0.0, None
        child.readiness = None
        uptime_s = now - child.started_s
        how = describe_exit(child.process.returncode)
        if not self.settings.restart:
            child.restart_at_s = float("inf")
            log.warning("%s (pid %d) %s after %.0fs up; nginx sends its traffic to the others; "
                        "not restarted (--no-restart)", child.name, child.process.pid, how,
                        uptime_s)  # fmt: skip
            return
        child.backoff_s = next_backoff(
            child.backoff_s, uptime_s, first_s=self.settings.restart_backoff_s,
            max_s=self.settings.restart_backoff_max_s, reset_after_s=self.settings.restart_reset_s,
        )  # fmt: skip
        child.restart_at_s = now + child.backoff_s
        log.warning("%s (pid %d) %s after %.0fs up; nginx sends its traffic to the others; "
                    "restarting it in %.1fs. Its log: %s\n%s", child.name, child.process.pid,
                    how, uptime_s, child.backoff_s, child.log_path,
                    child.log_tail(10))  # fmt: skip

    def _check_ready(self, child: Child) -> None:
        """Ask a replica that is not ready (restarted) whether it is, on a thread, as
        ``_check_liveness`` asks: one that hangs while it starts holds no loop either."""
        asked = child.readiness
        if asked is None:
            child.readiness = self._questions.submit(ask_ready, f"{child.url}/health/ready")
            return
        if not asked.done():
            return
        child.readiness = None
        if asked.result():
            child.ready = True
            self._say(f"{child.name}: ready again (pid {child.process.pid}, "
                      f"restart {child.num_restarts})")  # fmt: skip

    def _check_liveness(self, child: Child, now: float) -> None:
        """Ask a ready replica's /health/live every ``liveness_period_s``, on a thread; after
        ``liveness_failures`` questions in a row without a 200, kill it (SIGKILL: a hung event
        loop runs no SIGTERM handler). The next look finds it dead and restarts it; Nginx
        retries the requests it held (their connections are reset) on the others."""
        settings = self.settings
        if not settings.liveness_failures:
            return
        asked = child.liveness
        if asked is None:
            if now >= child.next_liveness_s:
                child.liveness = self._questions.submit(
                    ask_live, f"{child.url}/health/live", settings.liveness_timeout_s
                )
            return
        if not asked.done():
            return
        child.liveness = None
        problem = asked.result()
        child.next_liveness_s = time.monotonic() + settings.liveness_period_s
        if problem is None:
            child.unanswered = 0
            return
        child.unanswered += 1
        log.warning("%s (pid %d): /health/live %s (%d in a row; killed at %d)", child.name,
                    child.process.pid, problem, child.unanswered,
                    settings.liveness_failures)  # fmt: skip
        if child.unanswered >= settings.liveness_failures and child.alive():
            log.error("%s (pid %d) is alive but does not answer /health/live; killing it "
                      "(SIGKILL)", child.name, child.process.pid)  # fmt: skip
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()

    def _restart(self, child: Child) -> None:
        child.num_restarts += 1
        child.restart_at_s = None
        child.started_s = time.monotonic()
        with open(child.log_path, "ab") as log_file:
            log_file.write(f"--- batchfit up: restart {child.num_restarts} ---\n".encode())
        child.process = self._spawn(list(child.argv), child.log_path, child.env, append=True)
        self._say(f"{child.name}: restarted, pid {child.process.pid} "
                  f"(restart {child.num_restarts})")  # fmt: skip

    def _report_stop(self, prefix: Path, *, remove: bool) -> None:
        """Say what was stopped, how each process ended and where its logs are."""
        children = ([self.nginx] if self.nginx is not None else []) + self.replicas
        for child in children:
            code = child.process.returncode
            restarts = f", restarted {child.num_restarts}x" if child.num_restarts else ""
            self._say(f"batchfit up: stopped {child.name} (pid {child.process.pid}, "
                      f"exit code {code}{restarts}); log {child.log_path}")  # fmt: skip
        if remove:
            shutil.rmtree(prefix, ignore_errors=True)
            self._say(f"batchfit up: removed {prefix} (--no-keep-logs)")
        else:
            self._say(f"batchfit up: logs kept in {prefix}")

    def _stop_all(self) -> None:
        # Nginx first (graceful: finishes the requests it is proxying), then every replica at
        # once, so each drains its accepted work.
        if self.nginx is not None:
            stop_children([self.nginx], signal.SIGQUIT, self.settings.stop_timeout_s)
        stop_children(self.replicas, signal.SIGTERM, self.settings.stop_timeout_s)
