"""An API process's view of the engine: a stand-in for ``Runtime`` that the app's routes
use as they use the real one, with the queue, batcher and model in the engine process.

Inputs are tokenized here (inline, or on a tokenizer thread past the engine's measured
limit) and sent as items; the answer's future ends on the engine's result or error, the
deadline (with a grace for the engine's own answer), the client going away, or the engine
process going away (503 ``engine_unavailable`` at once: its end of our stdin closes). The
deadline counts from the request's arrival here: the engine is given what is left of it.

A generation request's tokens come back as they are generated (``RemoteGeneration``, in
``remote_parts.py`` with the other pieces the routes hold).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from batching import ModelThread
from generation import SequenceSpec
from models import ProfileStatus

from ..errors import ApiError, deadline_exceeded, draining, model_not_found, not_ready
from ..heap import freeze_startup_heap
from ..long_inputs import pool_answer, unwindow
from ..metrics import ServerMetrics
from ..runtime import ClientDisconnected, ClientWatch, RequestTrace
from ..runtime.requests import tokenize_on
from ..runtime.slot import prepare_call, tokenize_inline
from ..settings import Settings
from . import wire
from .link import Link
from .remote_parts import (
    DEADLINE_GRACE_S,
    ENGINE_LATE,
    QueueDepth,
    RemoteGeneration,
    RemoteSlot,
    engine_gone,
)

log = logging.getLogger("batchfit")

ENGINE_SILENCE_S = 5.0
"""The engine says its state every 0.2 s (``host.STATE_INTERVAL_S``); silent this long once
its models have come, it is hung (stopped, or its event loop stuck), and /health/live says
so: this process answers on, so its own liveness says nothing about the engine's."""
ENGINE_FRESH_S = 2.0
"""Ready only while the engine was heard from this recently (ten of its state messages, so
that a busy engine on a small host is not taken for a silent one): its last word says ready,
but an engine stopped or stuck since would leave new requests to wait out their deadline (and
the grace) here, long before ``ENGINE_SILENCE_S`` calls it hung. Not ready is what load
balancers act on by taking this replica out."""


class RemoteRuntime:
    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry,
        link_fd: int,
        index: int,
        stdin_fd: int,
        on_exit: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: seconds on the loop's time base (tests pass a fake one)."""
        self.settings = settings
        self.config = settings.server_config()
        self.registry = registry
        self.metrics = ServerMetrics(registry, max_latency_s=settings.max_timeout_s)
        self.slots: dict[str, RemoteSlot] = {}
        self.queue = QueueDepth()
        self.startup_error: BaseException | None = None
        self.batcher_error: BaseException | None = None
        self._link_fd = link_fd
        self._link: Link | None = None
        self._index = index
        self._stdin_fd = stdin_fd
        self._on_exit = on_exit
        self._clock = clock
        self._engine_ready = False
        self._engine_draining = False
        self._stopping = False
        self.engine_lost = False
        self._numbers = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._generations: dict[int, RemoteGeneration] = {}
        self._tokenizer = ModelThread("batchfit-tokenize")
        self._inferring = 0  # inference requests in progress here
        self._heard: asyncio.Event | None = None
        self._heard_s: float | None = None  # the engine's latest state (once it is loaded)
        self._hung: str | None = None  # why the engine's model thread is hung, as it said
        self.status_history: Any = None
        """This process's ``StatusHistory`` (set by ``create_app``): it only counts the
        requests answered here, which the engine takes before each of its samples."""

    @property
    def ready(self) -> bool:
        heard = self._heard_s
        return (
            bool(self.slots) and self._engine_ready and not self.draining
            and heard is not None and self._clock() - heard < ENGINE_FRESH_S
        )  # fmt: skip

    def liveness_problem(self) -> ApiError | None:
        """As ``Runtime.liveness_problem``: the engine's (its model thread hung), or an engine
        silent for ``ENGINE_SILENCE_S`` (a lost one is not hung: this process is exiting,
        and says 503 to requests already)."""
        heard = self._heard_s
        if heard is None or self.engine_lost:
            return None
        if self._hung is not None:
            return ApiError(503, "model_hung", self._hung, retry_after_s=1)
        silent_s = self._clock() - heard
        if silent_s < ENGINE_SILENCE_S:
            return None
        return ApiError(
            503, "engine_unavailable",
            f"the engine process of this replica has said nothing for {silent_s:.0f}s",
            retry_after_s=1,
        )  # fmt: skip

    @property
    def draining(self) -> bool:
        return self._engine_draining or self._stopping or self.engine_lost

    def slot(self, name: str | None = None, *, task: str | None = None) -> RemoteSlot:
        """As ``Runtime.slot``."""
        if not self.slots:
            raise not_ready()
        if name is None:
            slots = list(self.slots.values())
            of_task = [s for s in slots if task is not None and s.info.task == task]
            return (of_task or slots)[0]
        found = self.slots.get(name)
        if found is None:
            raise model_not_found(name, list(self.slots))
        return found

    # -- lifetime (the app's lifespan) ---------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._heard = asyncio.Event()
        loop.add_reader(self._stdin_fd, self._stdin_readable)
        await self._tokenizer.call(int)
        sock = socket.socket(fileno=self._link_fd)
        self._link = await Link.open(sock, self._handle, self._link_lost)
        self._send(wire.HELLO, (self._index,))

    async def heard_from_engine(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the engine's first word: its models, if it is
        ready, come before it. The API process listens only then, so that it never answers
        503 ``not_ready`` beside others that are ready."""
        while self._heard is None:  # the lifespan's start-up task has not run yet
            await asyncio.sleep(0.001)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heard.wait(), timeout_s)

    async def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._stdin_fd)
        self._fail_pending(engine_gone())
        if self._link is not None:
            self._link.close()
        self._tokenizer.close(wait=False)

    async def drain(self, timeout_s: float) -> bool:
        """Only the engine drains; here nothing is left once it has answered."""
        return True

    def abort(self) -> int:
        return 0

    def _stdin_readable(self) -> None:
        try:
            data = os.read(self._stdin_fd, 4096)
        except OSError:
            data = b""
        if data:
            return
        asyncio.get_running_loop().remove_reader(self._stdin_fd)
        self._engine_lost()

    def _link_lost(self) -> None:
        self._engine_lost()

    def _engine_lost(self) -> None:
        if self._stopping or self.engine_lost:
            return
        log.error("the engine process is gone; failing %d requests and stopping",
                  len(self._pending) + len(self._generations))  # fmt: skip
        self.engine_lost = True
        self._fail_pending(engine_gone())
        if self._heard is not None:  # a start-up waiting for the engine's first word ends,
            self._heard.set()  # even if the engine died before it began to wait
        self._on_exit(1)

    def _fail_pending(self, error: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for run in list(self._generations.values()):
            run.end(error)  # no cancel: the engine is not there to hear it

    # -- messages ------------------------------------------------------------------------

    def _send(self, kind: bytes, header: Any, *frames: Any) -> None:
        assert self._link is not None
        self._link.send(kind, header, *frames)

    def _handle(self, kind: bytes, header: Any, frames: list[bytes]) -> None:
        if kind == wire.RESULT:
            future = self._pending.get(header[0])
            if future is not None and not future.done():
                future.set_result((header, frames))
        elif kind == wire.TOKENS:
            run = self._generations.get(header[0])
            if run is not None:
                run.put(wire.loads(frames[0]))
        elif kind == wire.END:
            run = self._generations.get(header[0])
            if run is not None:
                run.end()
        elif kind == wire.ERROR:
            number, status, error_type, message, retry_after_s = header
            error = ApiError(status, error_type, message, retry_after_s=retry_after_s)
            future = self._pending.get(number)
            if future is not None and not future.done():
                future.set_exception(error)
            run = self._generations.get(number)
            if run is not None:
                run.end(error)
        elif kind == wire.STATE:
            self._engine_ready, self._engine_draining, self.queue.depth, self._hung = header
            if self.slots:  # its silence is judged once the engine has loaded its models
                self._heard_s = self._clock()
            if self._heard is not None:
                self._heard.set()
        elif kind == wire.MODELS:
            self.slots = {name: RemoteSlot(name, *rest) for name, *rest in header}
            freeze_startup_heap()  # as a single-process replica does once ready
        elif kind == wire.COLLECT:
            (number,) = header
            self._send(wire.SNAPSHOT, (number, list(self.registry.collect())))
        elif kind == wire.TAKE:
            (tally,) = header
            taken = self.status_history.take() if self.status_history is not None else (0, 0, [])
            self._send(wire.TALLY, (tally, *taken))
        elif kind == wire.EXPOSITION:
            future = self._pending.get(header[0])
            if future is not None and not future.done():
                future.set_result(frames[0])
        elif kind in (wire.SAMPLES, wire.PROFILED):
            future = self._pending.get(header[0])
            if future is not None and not future.done():
                future.set_result(header[1])
        elif kind == wire.STOP:
            self._stopping = True
            asyncio.get_running_loop().create_task(self._stop_when_answered())

    async def _stop_when_answered(self) -> None:
        while self._pending or self._generations:
            await asyncio.sleep(0.01)
        self._on_exit(0)

    async def _call(self, kind: bytes, header: tuple[Any, ...], *frames: Any,
                    timeout_s: float, client: ClientWatch | None = None) -> Any:  # fmt: skip
        """Send a request numbered here; wait for the engine's answer to it."""
        if self.engine_lost:
            raise engine_gone()
        loop = asyncio.get_running_loop()
        number = next(self._numbers)
        future = self._pending[number] = loop.create_future()
        sent = False

        def client_gone() -> None:
            if not future.done():
                future.set_exception(ClientDisconnected())
                if sent:  # the engine ignores a CANCEL for a number it has not seen
                    self._send(wire.CANCEL, (number,))

        def too_late() -> None:
            if not future.done():
                future.set_exception(ApiError(504, "deadline_exceeded", ENGINE_LATE))
                self._send(wire.CANCEL, (number,))

        timer = loop.call_later(timeout_s, too_late)
        # NOTE: a client already gone (it left while its inputs were tokenized) ends the
        # future here, at once, and the engine hears nothing of the request. Only a request
        # sent is cancelled: the engine ignores a CANCEL for a number it has not seen, and
        # an INFER after it would run every input for nobody.
        unsubscribe = client.subscribe(client_gone) if client is not None else None
        try:
            if not future.done():
                self._send(kind, (number, *header), *frames)
                sent = True
            return await future
        finally:
            timer.cancel()
            if unsubscribe is not None:
                unsubscribe()
            del self._pending[number]

    async def exposition(self) -> bytes:
        """The replica's metrics, merged by the engine (``merge.py``)."""
        return await self._call(wire.METRICS, (), timeout_s=10.0)

    async def status_samples(self, since: float | None) -> list[dict[str, Any]]:
        """The replica's status samples, from the engine's history (newer than ``since``)."""
        return await self._call(wire.STATUS, (since,), timeout_s=10.0)

    async def profile(self, num_batches: int | None) -> ProfileStatus:
        """The engine's profiler armed for ``num_batches`` (None: as it is), and its state
        (``admin.profile``, in the engine: its errors come back as they are)."""
        return await self._call(wire.PROFILE, (num_batches,), timeout_s=10.0)

    async def infer(
        self,
        inputs: Sequence[str],
        *,
        truncate: bool,
        timeout_s: float,
        request_id: str,
        priority: int = 0,
        model: str | None = None,
        query: str | None = None,
        trace: RequestTrace | None = None,
        prompt: str | None = None,
        truncation_direction: str | None = None,
        client: ClientWatch | None = None,
        dimensions: int | None = None,
        max_tokens_per_doc: int | None = None,
        chunk: bool = False,
        late_chunks: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> tuple[list[Any], int]:
        """As ``Runtime.infer``: tokenized here (``truncation_direction``,
        ``max_tokens_per_doc``, the windows of ``chunk`` and the spans of ``late_chunks``
        apply here); looked up in the output cache, queued and run in the engine, which also
        cuts to ``dimensions`` (chunked inputs: cut here, once pooled)."""
        arrival_s = self._clock()  # the deadline counts from here, tokenizing included
        if self.engine_lost:
            raise engine_gone()
        if self.draining:
            raise draining()
        if not self.ready:
            raise not_ready()
        slot = self.slot(model)
        trace = trace if trace is not None else RequestTrace()
        prepare = prepare_call(
            slot.model, inputs, name=slot.name, truncate=truncate, query=query, prompt=prompt,
            truncation_direction=truncation_direction, max_tokens_per_doc=max_tokens_per_doc,
            chunk=chunk, late_chunks=late_chunks,
        )  # fmt: skip
        # As in one process: a request alone here is tokenized inline up to a larger size.
        inline = tokenize_inline(slot, inputs, query=query, prompt=prompt,
                                 alone=not self._inferring)  # fmt: skip
        self._inferring += 1
        try:
            if inline:
                prepared = prepare()
            else:
                prepared = await tokenize_on(
                    self._tokenizer, prepare, remaining_s=arrival_s + timeout_s - self._clock(),
                    timeout_s=timeout_s,
                )  # fmt: skip
            trace.tokenize_s = self._clock() - arrival_s
            items, windows = unwindow(prepared)
            cut = None if windows is not None else dimensions
            trace.inputs, trace.tokens = len(items), sum(item.cost for item in items)
            # The engine counts the deadline from its own arrival: it is given what is left.
            left_s = arrival_s + timeout_s - self._clock()
            if left_s <= 0:  # it waited its whole deadline to be tokenized: never sent
                raise deadline_exceeded(timeout_s)
            try:
                header, frames = await self._call(
                    wire.INFER, (slot.name, left_s, priority, request_id, cut),
                    wire.dumps(items),
                    timeout_s=left_s + DEADLINE_GRACE_S, client=client,
                )  # fmt: skip
            except ApiError as error:
                # The engine's 504 names the deadline it was given; the client's is timeout_s.
                if error.error_type == "deadline_exceeded" and error.message != ENGINE_LATE:
                    raise deadline_exceeded(timeout_s) from None
                raise
        finally:
            self._inferring -= 1
        _, meta, tokens, trace.queue_wait_s, trace.batch_sizes, trace.cache_hits, batches = header
        trace.batches = list(batches)
        outputs = wire.decode_outputs(meta, frames)
        if windows is not None:
            outputs = pool_answer(outputs, windows, slot.info, dimensions)
        return outputs, tokens

    def generate(
        self, specs: Sequence[SequenceSpec], *, model: str, priority: int, timeout_s: float,
        client: ClientWatch | None = None,
    ) -> RemoteGeneration:  # fmt: skip
        """As ``Runtime.generate``: sent to the engine, which admits it (its 429 comes from
        the first ``next_events``) and sends its events back as they come."""
        if self.engine_lost:
            raise engine_gone()
        if self.draining:
            raise draining()
        if not self.ready:
            raise not_ready()
        slot = self.slot(model)
        number = next(self._numbers)
        run = self._generations[number] = RemoteGeneration(self, number, slot.name)
        run.start(specs, priority=priority, timeout_s=timeout_s, client=client)
        return run
