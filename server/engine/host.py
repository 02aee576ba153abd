"""The engine process: one ``Runtime``, its API processes, and the sockets between.

``serve_engine`` binds the public port, starts the API processes (``worker.py``) on that
one listening socket, each with its end of a Unix socket pair to the engine (``link.py``),
and serves their requests from the runtime until SIGTERM (a drain:
the API processes answer 503 ``draining``, admitted work finishes, every process exits 0)
or a fatal error (exit 1). An API process that dies is started again; its queued inputs
leave the queue as a client's would. What the engine keeps of each API process, and its
answers to their requests, are in ``api_processes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics

from batching import at_home

from ..admin import profile
from ..disconnect import ConnectionWatch
from ..errors import ApiError
from ..heap import freeze_startup_heap
from ..metrics_server import serve_metrics
from ..runtime import Runtime
from ..settings import Settings
from ..status import StatusHistory
from ..watchdog import loop_watchdog
from . import wire
from .api_processes import (
    WorkerProcess,
    answer_generation,
    answer_infer,
    error_detail,
    listening_socket,
)
from .link import Link
from .merge import exposition, merge_families

log = logging.getLogger("batchfit")

STATE_INTERVAL_S = 0.2
"""How often each API process hears whether the engine is ready, and its queue depth."""
SNAPSHOT_TIMEOUT_S = 2.0
"""A scrape waits this long for each API process's series (one that died is left out)."""
TALLY_TIMEOUT_S = 0.5
"""A status sample waits this long for each API process's requests (a late one counts in
the next sample)."""
WORKER_STOP_GRACE_S = 15.0
"""After the drain, how long the API processes may take to answer and close."""
MAX_FAILED_STARTS = 3
"""API processes in a row that exit before they say hello end the replica (exit status 1)."""


class EngineHost:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.runtime = Runtime(
            settings, registry=self.registry, on_fatal=self._fatal, on_ready=freeze_startup_heap
        )
        self.workers: dict[int, WorkerProcess] = {}
        self._stopping = asyncio.Event()
        self._failed = False
        self._failed_starts = 0
        """API processes in a row that exited before they said hello."""
        self._collects: dict[int, tuple[asyncio.Future[None], list[Any]]] = {}
        self._next_collect = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._models_message: bytes | None = None
        # The status page's one history for the replica: the engine's series and queue,
        # and every API process's requests, gathered before each sample.
        self.status = StatusHistory(
            self.registry, queue_depth=lambda: len(self.runtime.queue),
            window_s=settings.status_window_s,
        )  # fmt: skip
        self._tallies: tuple[int, asyncio.Future[None], set[int]] | None = None
        self._next_tally = 0

    # -- lifetime ------------------------------------------------------------------------

    async def run(self, listener: socket.socket) -> int:
        async with contextlib.AsyncExitStack() as stack:
            stack.enter_context(loop_watchdog(self.settings.hang_timeout_s))
            if self.settings.metrics_port is not None:  # the API processes leave it to us
                await stack.enter_async_context(serve_metrics(
                    self.merged_exposition, host=self.settings.host,
                    port=self.settings.metrics_port,
                ))  # fmt: skip
            return await self._serve(listener)

    async def _serve(self, listener: socket.socket) -> int:
        loop = asyncio.get_running_loop()
        self._listener = listener
        for index in range(self.settings.api_workers):
            self._spawn(index)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signal)
        starting = self._spawn_task(self.runtime.start())
        ticking = self._spawn_task(self._tick())
        sampling = self._spawn_task(self.status.run(self._gather_tallies))
        try:
            await self._stopping.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self._stop_workers()
            for task in (starting, ticking, sampling):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.runtime.stop()
            for worker in self.workers.values():
                if worker.link is not None:
                    worker.link.close()
        failed = (
            self._failed
            or self.runtime.startup_error is not None
            or self.runtime.batcher_error is not None
        )
        return 1 if failed else 0

    def _spawn_task(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn(self, index: int) -> None:
        """Start API process ``index``: its stdin brings its settings and, by closing,
        tells it the engine is gone; its end of a socket pair is its link to us."""
        fd = self._listener.fileno()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs, at_home():  # not the CPU the event loop may be held to
            process = subprocess.Popen(
                # -P: the working directory stays off sys.path, where a folder named like one
                # of ours (models/, say) would hide the package and every start would fail.
                [sys.executable, "-P", "-m", "server.engine.worker"],
                stdin=subprocess.PIPE,
                pass_fds=(fd, theirs.fileno()),
            )
            assert process.stdin is not None
            process.stdin.write(wire.dumps((self.settings, theirs.fileno(), fd, index)))
            process.stdin.flush()  # kept open: its end is the API process's sign of our life
        worker = WorkerProcess(index, process)
        self.workers[index] = worker
        self._spawn_task(self._connect(worker, ours))
        pidfd = os.pidfd_open(process.pid)
        asyncio.get_running_loop().add_reader(pidfd, self._worker_exited, worker, pidfd)
        log.info("API process %d started (pid %d)", index, process.pid)

    async def _connect(self, worker: WorkerProcess, sock: socket.socket) -> None:
        def received(kind: bytes, header: Any, frames: list[bytes]) -> None:
            self._handle(worker, kind, header, frames)

        worker.link = await Link.open(sock, received, lambda: None)

    def _worker_exited(self, worker: WorkerProcess, pidfd: int) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        code = worker.process.wait()
        with contextlib.suppress(OSError):
            assert worker.process.stdin is not None
            worker.process.stdin.close()
        worker.greeted = False
        if worker.link is not None:
            worker.link.close()
        for watch in list(worker.open.values()):
            watch.connection_lost()  # its queued inputs leave the queue
        if self.workers.get(worker.index) is worker:
            del self.workers[worker.index]
        if self._stopping.is_set() or self.runtime.draining:
            return
        # One that dies before it ever said hello cannot start (an import or a setting that
        # fails every time): after a few in a row, stop the replica rather than loop.
        self._failed_starts = 0 if worker.said_hello else self._failed_starts + 1
        if self._failed_starts >= MAX_FAILED_STARTS:
            log.error(
                "API process %d (pid %d) exited with %s before it started, %d times in a row; "
                "stopping the replica (its log above says why)",
                worker.index, worker.process.pid, code, self._failed_starts,
            )  # fmt: skip
            self._fatal()
            return
        log.error("API process %d (pid %d) exited with %s; starting it again",
                  worker.index, worker.process.pid, code)  # fmt: skip
        self._spawn(worker.index)

    def _signal(self) -> None:
        if self.runtime.draining:
            log.warning("second signal: answering what is left with 503 and stopping")
            self.runtime.abort()
            return
        self._spawn_task(self._drain())

    async def _drain(self) -> None:
        self.runtime.begin_drain()
        self._send_state()
        try:
            await self.runtime.drain(self.settings.drain_timeout_s)
            # The last answers are on their way to the API processes.
            while any(worker.open for worker in self.workers.values()):
                await asyncio.sleep(0.01)
        finally:
            self._stopping.set()

    def _fatal(self) -> None:
        self._failed = True
        self._stopping.set()

    async def _stop_workers(self) -> None:
        """Tell every API process to stop once its requests are answered; wait for them."""
        self.runtime.begin_drain()
        self._send_state()
        for worker in list(self.workers.values()):
            if worker.greeted:
                worker.send(wire.STOP, ())
            else:  # still starting: it serves nothing yet
                worker.process.kill()
        deadline = asyncio.get_running_loop().time() + WORKER_STOP_GRACE_S
        while self.workers and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for worker in list(self.workers.values()):
            log.warning("API process %d did not stop; killing it", worker.index)
            worker.process.kill()
            worker.process.wait()

    async def _tick(self) -> None:
        while True:
            self._send_state()
            await asyncio.sleep(STATE_INTERVAL_S)

    # -- messages ------------------------------------------------------------------------

    def _send_state(self) -> None:
        runtime = self.runtime
        hung = runtime.liveness_problem()  # the model thread's: the API processes answer it
        state = (runtime.ready, runtime.draining, len(runtime.queue), hung and hung.message)
        for worker in self.workers.values():
            if not worker.greeted or worker.link is None:
                continue
            if runtime.slots and not worker.models_sent:
                worker.models_sent = True
                models = self._models()
                if models is None:
                    return
                worker.link.send_parts([wire.MODELS, models])
            worker.send(wire.STATE, state)

    def _models(self) -> bytes | None:
        """Each model's name, card, what tokenizes for it and its inline limits, pickled
        once; None (and the replica stops) where a model cannot be sent."""
        if self._models_message is None:
            found = []
            for name, slot in self.runtime.slots.items():
                model = slot.model
                preparer = model.preparer() if hasattr(model, "preparer") else model
                found.append((name, slot.card(), preparer, slot.inline_tokenize_chars,
                              slot.idle_inline_chars))  # fmt: skip
            try:
                self._models_message = wire.dumps(found)
            except Exception as exc:
                log.error(
                    "--api-workers: a model's tokenizer cannot be sent to the API processes "
                    "(%s); give the model a preparer() (models/base.py) or serve it with "
                    "--api-workers 1", exc,
                )  # fmt: skip
                self._fatal()
                return None
        return self._models_message

    def _handle(self, worker: WorkerProcess, kind: bytes, header: Any, frames: list[bytes]) -> None:
        if self.workers.get(worker.index) is not worker:
            return  # a process that has exited already
        if kind == wire.HELLO:
            worker.greeted = worker.said_hello = True
            self._send_state()
            return
        if kind == wire.INFER:
            number = header[0]
            watch = worker.open[number] = ConnectionWatch()
            self._spawn_task(answer_infer(self.runtime, worker, header, frames[0], watch))
        elif kind == wire.GENERATE:
            number = header[0]
            watch = worker.open[number] = ConnectionWatch()
            self._spawn_task(answer_generation(self.runtime, worker, header, frames[0], watch))
        elif kind == wire.CANCEL:
            watch = worker.open.get(header[0])
            if watch is not None:
                watch.connection_lost()
        elif kind == wire.METRICS:
            self._spawn_task(self._scrape(worker, header[0]))
        elif kind == wire.TALLY:
            tally, requests, errors, latencies_s = header
            self.status.add(requests, errors, latencies_s)  # a late one counts in the next
            waiting = self._tallies
            if waiting is not None and waiting[0] == tally:
                waiting[2].discard(worker.index)
                if not waiting[2] and not waiting[1].done():
                    waiting[1].set_result(None)
        elif kind == wire.STATUS:
            number, since = header
            worker.send(wire.SAMPLES, (number, self.status.since(since)))
        elif kind == wire.PROFILE:
            number, num_batches = header
            try:
                state = profile(self.runtime.profiler, num_batches)
            except ApiError as error:
                worker.send(wire.ERROR, error_detail(number, error))
            else:
                worker.send(wire.PROFILED, (number, state))
        elif kind == wire.SNAPSHOT:
            number, families = header
            waiting = self._collects.get(number)
            if waiting is not None:
                waiting[1].append(families)
                if len(waiting[1]) >= len(self._greeted()) and not waiting[0].done():
                    waiting[0].set_result(None)

    def _greeted(self) -> list[WorkerProcess]:
        return [worker for worker in self.workers.values() if worker.greeted]

    async def _scrape(self, asker: WorkerProcess, number: int) -> None:
        asker.send(wire.EXPOSITION, (number,), await self.merged_exposition())

    async def merged_exposition(self) -> bytes:
        """The replica's series: the engine's merged with every API process's."""
        collect = self._next_collect = self._next_collect + 1
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        snapshots: list[Any] = []
        self._collects[collect] = (done, snapshots)
        try:
            for other in self._greeted():
                other.send(wire.COLLECT, (collect,))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done, SNAPSHOT_TIMEOUT_S)
        finally:
            del self._collects[collect]
        return exposition(merge_families([list(self.registry.collect()), *snapshots]))

    async def _gather_tallies(self) -> None:
        """Before a status sample: every API process's requests since the last one."""
        greeted = self._greeted()
        if not greeted:
            return
        tally = self._next_tally = self._next_tally + 1
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tallies = (tally, done, {worker.index for worker in greeted})
        try:
            for worker in greeted:
                worker.send(wire.TAKE, (tally,))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done, TALLY_TIMEOUT_S)
        finally:
            self._tallies = None


def _loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve_engine(settings: Settings) -> int:
    """``batchfit serve`` with ``--api-workers`` of 2 or more."""
    listener = listening_socket(settings.host, settings.port)
    log.info(
        "listening on http://%s:%d with %d API processes; loading the model (/health/ready "
        "is 503 until ready)", settings.host, settings.port, settings.api_workers,
    )  # fmt: skip
    host = EngineHost(settings)
    try:
        # The event loop uvicorn gives a single-process replica, where installed.
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            code = runner.run(host.run(listener))
    finally:
        listener.close()
    if host.runtime.model_thread.busy:
        # As a single-process replica (server/cli.py): stopped while loading or warming up,
        # the interpreter would wait at exit for the model thread's load or forward pass.
        log.warning("exiting without waiting for the model thread to finish")
        logging.shutdown()
        os._exit(code)
    return code
