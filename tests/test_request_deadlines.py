"""A request's deadline counts from its arrival, the wait for the tokenizer thread included;
items dropped at their deadline are counted; an API process (``--api-workers``) sends the
engine nothing for a client already gone, and is ready only while the engine speaks.

The request side is driven without a batcher (what is queued stays queued), a fake clock
stands for the time spent waiting, and a gate holds the tokenizer thread: no test sleeps to
prove that something has not happened, and timeouts only guard against hangs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from batching import BatchingMetrics, ModelThread, RequestQueue
from models import Item
from server import Settings
from server.cache import InputCache
from server.disconnect import ConnectionWatch
from server.engine import wire
from server.engine.link import Link
from server.engine.remote import ENGINE_FRESH_S, ENGINE_SILENCE_S, RemoteRuntime, RemoteSlot
from server.errors import ApiError
from server.runtime import ClientDisconnected, RequestTrace
from server.runtime.requests import RequestPath
from server.runtime.tracking import WorkTracker
from tests.fakes import FakeClock, ScriptedModel, scripted_items

TIMEOUT = 10  # guards against hangs only
MODEL = "scripted"


class GatedPreparer:
    """Tokenizes as a ``ScriptedModel`` does; a request whose first input starts with
    ``hold`` holds the thread that tokenizes it until ``gate`` opens."""

    def __init__(self) -> None:
        self.info = ScriptedModel().info
        self.gate = threading.Event()
        self.holding = threading.Event()  # set once a held request is being tokenized
        self.prepared: list[str] = []  # every input tokenized, in order

    def prepare(self, inputs: Sequence[str], *, truncate: bool) -> list[Item]:
        if inputs and inputs[0].startswith("hold"):
            self.holding.set()
            assert self.gate.wait(TIMEOUT)
        self.prepared.extend(inputs)
        return scripted_items(inputs)


async def until(predicate) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not predicate():
            await asyncio.sleep(0.001)


def api_error(outcome: BaseException | None) -> ApiError:
    assert isinstance(outcome, ApiError), repr(outcome)
    return outcome


# -- one process: the request path ------------------------------------------------------


class Harness:
    """A ``RequestPath`` over a queue nothing takes from, on a fake clock."""

    def __init__(
        self, *, inline_chars: float = 0.0, queue_items: int = 1024, piece_items: int = 256
    ) -> None:
        self.registry = CollectorRegistry()
        self.clock = FakeClock()
        self.queue = RequestQueue(queue_items)
        self.queued: list[str] = []  # the request ids of every item put in the queue
        put_many = self.queue.put_many

        def recording(pendings):
            self.queued.extend(pending.request_id for pending in pendings)
            return put_many(pendings)

        self.queue.put_many = recording
        self.tokenizer_thread = ModelThread("test-tokenize")
        self.work = WorkTracker(self.registry, clock=self.clock)
        self.path = RequestPath(
            queue=self.queue,
            inputs=InputCache(self.registry, max_bytes=0, deduplicate=False, queue=self.queue),
            clock=self.clock,
            work=self.work,
            tokenizer_thread=self.tokenizer_thread,
            metrics=BatchingMetrics(self.registry, max_batch_size=32, max_batch_tokens=4096),
            piece_items=piece_items,
        )
        self.preparer = GatedPreparer()
        # 0 characters inline: every request goes to the tokenizer thread.
        self.slot = SimpleNamespace(
            name=MODEL, model=self.preparer, info=self.preparer.info,
            inline_tokenize_chars=inline_chars, idle_inline_chars=inline_chars,
        )  # fmt: skip

    def infer(self, inputs: list[str], *, timeout_s: float, request_id: str) -> asyncio.Task:
        async def request():
            with self.work.request():
                return await self.path.infer(
                    self.slot, inputs, truncate=True, timeout_s=timeout_s,
                    request_id=request_id, priority=0, query=None, trace=RequestTrace(),
                    client=None,
                )  # fmt: skip

        return asyncio.get_running_loop().create_task(request())

    def answer_queued(self) -> None:
        """What the batcher would do: every queued item's answer."""
        for pending in self.queue.waiting(1024):
            pending.future.set_result(f"out:{pending.item.data}")

    def cancelled_queued(self) -> float | None:
        return self.registry.get_sample_value("batchfit_cancelled_items_total", {"stage": "queued"})


@contextlib.asynccontextmanager
async def harness(**options):
    made = Harness(**options)
    try:
        yield made
    finally:
        made.preparer.gate.set()
        made.tokenizer_thread.close()


async def test_a_deadline_that_passes_while_waiting_for_the_tokenizer_ends_it_unqueued():
    async with harness() as h:
        first = h.infer(["hold the tokenizer"], timeout_s=300, request_id="first")
        await until(h.preparer.holding.is_set)
        behind = h.infer(["behind it"], timeout_s=60, request_id="behind")
        await until(lambda: h.tokenizer_thread.num_calls == 2)
        h.clock.advance(120)  # the wait for the tokenizer thread outlasts behind's deadline
        h.preparer.gate.set()
        async with asyncio.timeout(TIMEOUT):
            await asyncio.wait([behind])
        error = api_error(behind.exception())
        assert (error.status, error.error_type) == (504, "deadline_exceeded")
        assert "60s" in error.message  # the client's own timeout_s
        # Never queued: only the first request's item is (its deadline is 180 s away).
        assert h.queued == ["first"]
        h.answer_queued()
        async with asyncio.timeout(TIMEOUT):
            outputs, _ = await first
        assert outputs == ["out:hold the tokenizer"]


async def test_a_wait_for_the_tokenizer_thread_ends_at_the_deadline():
    async with harness() as h:
        first = h.infer(["hold the tokenizer"], timeout_s=300, request_id="first")
        await until(h.preparer.holding.is_set)
        # Its deadline passes on the loop's time while the first still holds the thread.
        behind = h.infer(["behind it"], timeout_s=0.05, request_id="behind")
        async with asyncio.timeout(TIMEOUT):
            await asyncio.wait([behind])
        assert not h.preparer.gate.is_set()
        error = api_error(behind.exception())
        assert (error.status, error.error_type) == (504, "deadline_exceeded")
        h.preparer.gate.set()
        await until(lambda: h.queued == ["first"])
        h.answer_queued()
        async with asyncio.timeout(TIMEOUT):
            await first
        await until(lambda: not h.tokenizer_thread.busy)
    # Its tokenization was still waiting for the thread: skipped, never run.
    assert h.preparer.prepared == ["hold the tokenizer"]
    assert h.queued == ["first"]


async def test_a_lone_request_tokenized_inline_sets_one_timer_as_before(monkeypatch):
    """Counting from the arrival costs the inline path a clock read: the request's wait keeps
    its one timer, and nothing goes to the tokenizer thread."""
    async with harness(inline_chars=float("inf")) as h:
        loop = asyncio.get_running_loop()
        timers = []
        original = loop.call_at

        def counted(when, callback, *args, **kwargs):
            timers.append(callback)
            return original(when, callback, *args, **kwargs)

        monkeypatch.setattr(loop, "call_at", counted)
        request = h.infer(["alone"], timeout_s=60, request_id="alone")
        # sleep(0), no guard: a sleep with a delay or a timeout would set a timer of its own.
        for _ in range(100):
            if h.queued:
                h.answer_queued()
            if request.done():
                break
            await asyncio.sleep(0)
        monkeypatch.undo()
        outputs, _ = request.result()
    assert h.queued == ["alone"]
    assert outputs == ["out:alone"]
    assert len(timers) == 1  # RequestWait's deadline
    assert h.tokenizer_thread.num_calls == 0


async def test_items_dropped_from_the_queue_at_their_deadline_are_counted():
    async with harness(inline_chars=float("inf")) as h:
        assert h.cancelled_queued() == 0
        request = h.infer(["one", "two"], timeout_s=0.05, request_id="late")
        async with asyncio.timeout(TIMEOUT):
            await asyncio.wait([request])
        error = api_error(request.exception())
        assert (error.status, error.error_type) == (504, "deadline_exceeded")
        assert h.queued == ["late", "late"]
        assert len(h.queue) == 0
        assert h.cancelled_queued() == 2


# -- an API process (--api-workers): RemoteRuntime against a fake engine -------------------


class FakeEngine:
    """The engine's end of an API process's link: records what it is sent, answers scrapes
    (so a test can wait for everything sent before one), says its state when told."""

    def __init__(self) -> None:
        self.received: list[tuple[bytes, tuple]] = []
        self.link: Link | None = None

    def handle(self, kind: bytes, header, frames) -> None:
        self.received.append((kind, header))
        if kind == wire.METRICS:
            self.link.send(wire.EXPOSITION, (header[0],), b"")

    def say_state(self, *, ready: bool = True) -> None:
        self.link.send(wire.STATE, (ready, False, 0, None))

    def infers(self) -> list[tuple]:
        return [header for kind, header in self.received if kind == wire.INFER]

    def answer(self, number: int, outputs: list) -> None:
        meta, frames = wire.encode_outputs(outputs)
        self.link.send(wire.RESULT, (number, meta, 1, 0.0, [1], 0, []), *frames)

    def fail(self, number: int, status: int, error_type: str, message: str) -> None:
        self.link.send(wire.ERROR, (number, status, error_type, message, None))


class RemoteHarness:
    def __init__(self, runtime: RemoteRuntime, engine: FakeEngine, clock: FakeClock) -> None:
        self.runtime, self.engine, self.clock = runtime, engine, clock
        self.preparer = GatedPreparer()
        # 0 characters inline: every request goes to the API process's tokenizer thread.
        runtime.slots = {MODEL: RemoteSlot(MODEL, {}, self.preparer, 0.0, 0.0)}

    def infer(self, inputs: list[str], *, timeout_s: float, client=None) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self.runtime.infer(
            inputs, truncate=True, timeout_s=timeout_s, request_id="r", client=client,
        ))  # fmt: skip

    async def everything_sent(self) -> None:
        """Wait until the engine has every message sent before now (the link keeps order)."""
        async with asyncio.timeout(TIMEOUT):
            await self.runtime.exposition()


@contextlib.asynccontextmanager
async def remote():
    engine_end, api_end = socket.socketpair()
    stdin_read, stdin_write = os.pipe()
    clock = FakeClock()
    runtime = RemoteRuntime(
        Settings(), registry=CollectorRegistry(), link_fd=api_end.detach(), index=0,
        stdin_fd=stdin_read, on_exit=lambda code: None, clock=clock.now,
    )  # fmt: skip
    engine = FakeEngine()
    made = RemoteHarness(runtime, engine, clock)
    try:
        await runtime.start()
        engine.link = await Link.open(engine_end, engine.handle, lambda: None)
        engine.say_state()
        await until(lambda: runtime.ready)
        yield made
    finally:
        made.preparer.gate.set()
        await runtime.stop()
        if engine.link is not None:
            engine.link.close()
        os.close(stdin_write)
        os.close(stdin_read)


async def test_an_api_process_is_not_ready_while_the_engine_is_silent():
    async with remote() as r:
        assert r.runtime.ready
        r.clock.advance(ENGINE_FRESH_S + 0.5)  # a stopped engine says nothing
        assert not r.runtime.ready
        assert r.runtime.liveness_problem() is None  # not yet hung: alive, not ready
        with pytest.raises(ApiError) as refused:
            await r.runtime.infer(["a"], truncate=True, timeout_s=60, request_id="r")
        assert (refused.value.status, refused.value.error_type) == (503, "not_ready")
        r.engine.say_state()  # it speaks again
        await until(lambda: r.runtime.ready)
        r.clock.advance(ENGINE_SILENCE_S + 1)
        assert not r.runtime.ready
        assert r.runtime.liveness_problem().error_type == "engine_unavailable"


async def test_the_engine_hears_nothing_of_a_client_gone_before_its_request_was_sent():
    async with remote() as r:
        watch = ConnectionWatch()
        request = r.infer(["hold the tokenizer"], timeout_s=60, client=watch)
        await until(r.preparer.holding.is_set)
        watch.connection_lost()  # the client goes while its inputs are being tokenized
        r.preparer.gate.set()
        with pytest.raises(ClientDisconnected):
            async with asyncio.timeout(TIMEOUT):
                await request
        gone = ConnectionWatch()
        gone.connection_lost()  # and one gone before it came to the engine at all
        with pytest.raises(ClientDisconnected):
            await r.runtime.infer(["a"], truncate=True, timeout_s=60, request_id="r",
                                  client=gone)  # fmt: skip
        await r.everything_sent()
    # An INFER would have to be followed by its CANCEL; sent before it, the CANCEL is
    # ignored and every input runs for nobody.
    kinds = [(kind, header[0]) for kind, header in r.engine.received if kind != wire.METRICS]
    for index, (kind, number) in enumerate(kinds):
        if kind == wire.INFER:
            assert (wire.CANCEL, number) in kinds[index + 1 :], kinds
    assert not any(kind == wire.CANCEL and (wire.INFER, n) not in kinds for kind, n in kinds)


async def test_an_api_process_counts_the_deadline_from_arrival_and_gives_the_engine_the_rest():
    async with remote() as r:
        first = r.infer(["hold the tokenizer"], timeout_s=300)
        await until(r.preparer.holding.is_set)
        behind = r.infer(["behind it"], timeout_s=60)
        await until(lambda: r.runtime._tokenizer.num_calls == 3)  # start()'s, and these two
        r.clock.advance(120)  # the wait for the tokenizer thread outlasts behind's deadline
        r.preparer.gate.set()
        async with asyncio.timeout(TIMEOUT):
            await asyncio.wait([behind])
        error = api_error(behind.exception())
        assert (error.status, error.error_type) == (504, "deadline_exceeded")
        assert "60s" in error.message
        await until(lambda: r.engine.infers())
        await r.everything_sent()
        [infer] = r.engine.infers()  # behind's never went to the engine
        number, _, timeout_s, *_ = infer
        assert timeout_s == pytest.approx(180)  # what is left of the first's 300 s
        r.engine.answer(number, ["out"])
        async with asyncio.timeout(TIMEOUT):
            outputs, _ = await first
        assert outputs == ["out"]


async def test_an_api_process_stops_waiting_for_its_tokenizer_at_the_deadline():
    async with remote() as r:
        first = r.infer(["hold the tokenizer"], timeout_s=300)
        await until(r.preparer.holding.is_set)
        behind = r.infer(["behind it"], timeout_s=0.05)
        async with asyncio.timeout(TIMEOUT):
            await asyncio.wait([behind])
        assert not r.preparer.gate.is_set()
        error = api_error(behind.exception())
        assert (error.status, error.error_type) == (504, "deadline_exceeded")
        r.preparer.gate.set()
        await until(lambda: r.engine.infers())
        [(number, *_)] = r.engine.infers()
        r.engine.answer(number, ["out"])
        async with asyncio.timeout(TIMEOUT):
            await first
        assert r.preparer.prepared == ["hold the tokenizer"]  # behind's: skipped


async def test_the_engines_deadline_error_names_the_clients_timeout():
    async with remote() as r:
        request = r.infer(["hold the tokenizer"], timeout_s=60)
        await until(r.preparer.holding.is_set)
        r.clock.advance(10)
        r.preparer.gate.set()
        await until(lambda: r.engine.infers())
        [(number, _, given_s, *_)] = r.engine.infers()
        assert given_s == pytest.approx(50)
        r.engine.fail(number, 504, "deadline_exceeded", "no answer within the deadline of 50s")
        async with asyncio.timeout(TIMEOUT):
            await asyncio.wait([request])
        error = api_error(request.exception())
        assert (error.status, error.error_type) == (504, "deadline_exceeded")
        assert "deadline of 60s" in error.message
