"""The one thread that runs every forward pass, and the hand-off to it and back.

torch on CPU loses 30-40% when its forwards hop between threads, so one thread runs them all.
A call crosses threads once each way: the job goes in through a ``SimpleQueue`` and its
outcome comes back to the event loop in one ``call_soon_threadsafe``, which settles the
awaiting future. (``loop.run_in_executor`` pays for a ``concurrent.futures.Future``, its
condition variable, and a chain of callbacks between the two futures on every call.) A call
in two parts (``call_then``, the batcher's forward passes) hands its answer back first and
the rest of its work after it. With ``colocate``, the thread and its caller share one CPU
while forward passes are light (``affinity``).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .affinity import Colocation, leave_inherited

T = TypeVar("T")
U = TypeVar("U")

_Job = tuple[
    Callable[..., Any],
    tuple[Any, ...],
    asyncio.AbstractEventLoop,
    asyncio.Future[Any],
    asyncio.Future[Any] | None,  # a call in two parts: the rest's outcome
]


class ModelThread:
    """Runs calls one at a time, in order, on one thread (started by the first call). The
    model's thread, and the same hand-off for the tokenizer's."""

    def __init__(self, name: str = "batchfit-model", *, colocate: bool = False) -> None:
        self._name = f"{name}_0"
        self.colocation = Colocation() if colocate else None
        """With ``colocate``: where the thread runs; its calls in two parts are timed."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.num_calls = 0
        """Calls handed to the thread so far (each is one hop there and one back)."""
        self._unfinished = 0  # calls queued or running; read by ``busy``
        self._call_started_s: float | None = None  # the running call's start (monotonic)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread; its result or exception comes back here. If the
        caller is cancelled first, a call still queued is skipped; a running one finishes
        and its outcome is dropped."""
        return await self.start(fn, *args)

    def start(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``call``, handed to the thread now: the caller awaits the future once it has done
        what need not delay the call (awaited, it is cancelled like ``call``)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._submit((fn, args, future.get_loop(), future, None))
        return future

    async def call_then(
        self, fn: Callable[..., tuple[T, Callable[[], U] | None]], *args: Any
    ) -> tuple[T, asyncio.Future[U | None]]:
        """Run ``fn(*args)`` on the thread; it returns ``(answer, then)``. The answer comes
        back at once, with a future for ``then``: where ``then`` is a callable, it runs on
        the thread next, its result or exception settling that future in a second hand-back;
        where it is None, the future is settled with None in the same hand-back as the
        answer. An exception from ``fn`` comes back here, the future cancelled with it.
        Cancelled like ``call``; a ``then`` whose caller is gone runs all the same."""
        answer, rest = self.start_then(fn, *args)
        return await answer, rest

    def start_then(
        self, fn: Callable[..., tuple[T, Callable[[], U] | None]], *args: Any
    ) -> tuple[asyncio.Future[T], asyncio.Future[U | None]]:
        """``call_then``, handed to the thread now, as ``start``: the answer's future, and the
        rest's."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[T] = loop.create_future()
        rest: asyncio.Future[U | None] = loop.create_future()
        self._submit((fn, args, loop, answer, rest))
        return answer, rest

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after the model thread closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self.num_calls += 1
            self._unfinished += 1
            if self.colocation is not None:
                if job[4] is None:
                    self.colocation.before_other()
                else:
                    self.colocation.before_forward()
            self._jobs.put(job)

    def running_for(self) -> float:
        """How long the call in progress (both parts of a call in two) has run; 0 between
        calls. A call that never returns (a hung device) shows here."""
        started = self._call_started_s
        return 0.0 if started is None else time.monotonic() - started

    @property
    def busy(self) -> bool:
        """Whether a call is running or waiting (one whose caller was cancelled included: a
        forward pass in progress cannot be interrupted)."""
        with self._lock:
            return self._unfinished > 0

    def _done(self) -> None:
        with self._lock:
            self._unfinished -= 1

    def close(self, *, wait: bool = True) -> None:
        """Cancel the calls still queued; with ``wait``, wait for the running one to end."""
        with self._lock:
            self._closed = True
            thread = self._thread
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self._unfinished -= 1
                    _, _, loop, future, rest = job
                    with contextlib.suppress(RuntimeError):  # its loop is already closed
                        loop.call_soon_threadsafe(_cancel, future, rest)
            self._jobs.put(None)
            if self.colocation is not None:
                self.colocation.release()
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _work(self) -> None:
        leave_inherited()
        colocation = self.colocation
        if colocation is not None:
            colocation.started()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, loop, future, rest = job
            # NOTE: read from another thread, but only ever set once (on the loop); a call
            # cancelled just after this check runs anyway and its outcome is dropped.
            if future.cancelled():
                self._done()
                if rest is not None:
                    self._hand_back(loop, _cancel, rest)
                continue
            result: Any = None
            then: Callable[[], Any] | None = None
            error: BaseException | None = None
            timed = colocation is not None and rest is not None
            started = time.thread_time() if timed else 0.0
            self._call_started_s = time.monotonic()
            try:
                result = fn(*args)
                if rest is not None:
                    result, then = result
            except BaseException as exc:  # every outcome goes back to the caller
                error = exc
            if then is not None:
                self._hand_back(loop, _settle, future, result, None)
                self._run_then(loop, rest, then)
            else:
                self._done()
                if rest is None:
                    self._hand_back(loop, _settle, future, result, error)
                else:
                    self._hand_back(loop, _settle_both, future, result, error, rest)
            self._call_started_s = None
            if timed:  # after the hand-back: the answer does not wait for the clock
                colocation.note(time.thread_time() - started)  # type: ignore[union-attr]
            del job, fn, args, result, then, error  # no reference outlives the call

    def _run_then(
        self, loop: asyncio.AbstractEventLoop, rest: asyncio.Future[Any], then: Callable[[], Any]
    ) -> None:
        """The second part of a call in two parts, once its answer is on its way back."""
        result: Any = None
        error: BaseException | None = None
        try:
            result = then()
        except BaseException as exc:
            error = exc
        self._hand_back(loop, _settle, rest, result, error)
        self._done()  # after: once not busy, the thread has handed back all it will

    @staticmethod
    def _hand_back(
        loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any
    ) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _settle_both(
    future: asyncio.Future[Any], result: Any, error: BaseException | None,
    rest: asyncio.Future[Any],
) -> None:  # fmt: skip
    """A call in two parts that ended in one: its answer (or the exception that took its
    place) and, with it, its rest (None, or cancelled after an exception)."""
    _settle(future, result, error)
    if error is None:
        _settle(rest, None, None)
    else:
        rest.cancel()


def _cancel(future: asyncio.Future[Any], rest: asyncio.Future[Any] | None = None) -> None:
    future.cancel()
    if rest is not None:
        rest.cancel()
