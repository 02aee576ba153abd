"""The one thread that runs every forward pass, and the hand-off to it and back.

torch on CPU loses 30-40% when its forwards hop between threads, so one thread runs them all.
A call crosses threads once each way: the job goes in through a ``SimpleQueue`` and its
outcome comes back to the event loop in one ``call_soon_threadsafe``, which settles the
awaiting future. (``loop.run_in_executor`` pays for a ``concurrent.futures.Future``, its
condition variable, and a chain of callbacks between the two futures on every call.)
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, asyncio.Future[Any]]


class ModelThread:
    """Runs calls one at a time, in order, on one thread (started by the first call). The
    model's thread, and the same hand-off for the tokenizer's."""

    def __init__(self, name: str = "batchfit-model") -> None:
        self._name = f"{name}_0"
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.num_calls = 0
        """Calls handed to the thread so far (each is one hop there and one back)."""
        self._unfinished = 0  # calls queued or running; read by ``busy``

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread; its result or exception comes back here. If the
        caller is cancelled first, a call still queued is skipped; a running one finishes
        and its outcome is dropped."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after the model thread closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self.num_calls += 1
            self._unfinished += 1
            self._jobs.put((fn, args, loop, future))
        return await future

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
                    _, _, loop, future = job
                    with contextlib.suppress(RuntimeError):  # its loop is already closed
                        loop.call_soon_threadsafe(future.cancel)
            self._jobs.put(None)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, loop, future = job
            # NOTE: read from another thread, but only ever set once (on the loop); a call
            # cancelled just after this check runs anyway and its outcome is dropped.
            if future.cancelled():
                self._done()
                continue
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as exc:  # every outcome goes back to the caller
                error = exc
            self._done()
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, future, result, error)
            del job, fn, args, result, error  # no reference outlives the call


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
