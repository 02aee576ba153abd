"""A bulk job's forward passes, watched: one that runs past a bound means a hung device or
model, and ends the process (the job's, or a Ray actor's).

A pass that never returns cannot be interrupted from Python: the thread running it is inside
torch's C++ or a driver call. Left alone, a job would wait on it for ever, the parts already
computed unwritten. ``PassWatch`` notes when each pass starts and ends (the calling thread
and every lane, ``passing``), and its own thread looks every ``poll_s``: once one pass has
run past its bound, it calls ``on_hang`` once, which writes what is finished and ends the
process (``bulk.job``; ``bulk.ray``, where Ray starts the actor again). The job resumes from
its manifest when run again.

A pass's bound is ``timeout_s``, or ``SLOWER`` times the time the job expects the pass to
take where that is longer: a large model on a CPU can take minutes over one large batch, and
a fixed bound below that would end a healthy job at the same place on every rerun.

A call that holds the GIL and never returns (C code that does not release it) stops every
Python thread, the watch's own included. So the watch also keeps ``faulthandler``'s timer
armed, re-arming it on every look: its thread needs neither the GIL nor Python. Once the
watch has not run for ``FROZEN_AFTER`` times the longest bound a pass has had (600 s by
default), the timer writes every thread's stack (under a ``Timeout (0:10:01)!`` line) and
ends the process with status 1; nothing else can run to write what is computed, and a rerun
resumes from the manifest.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("batchfit.bulk")

SLOWER = 10.0
"""A pass is hung once it has run this many times as long as expected (and ``timeout_s``)."""
FROZEN_AFTER = 2.0
"""The process ends once the watch has not run for this many times the longest bound..."""
MIN_FROZEN_S = 5.0
"""... and never sooner than this: a garbage collection over a large heap holds the GIL too."""


class PassWatch:
    """``on_hang(running_s, bound_s)`` once a pass has run past its bound (``passing``);
    ``start`` arms it."""

    def __init__(
        self,
        timeout_s: float,
        on_hang: Callable[[float, float], None],
        *,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._poll_s = poll_s
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[int, tuple[float, float]] = {}
        """The pass running on each thread (by ident): when it started, and its bound."""
        self._longest_bound_s = timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def passing(self, expected_s: float = 0.0) -> Iterator[None]:
        """Around one forward pass on the calling thread, expected to take ``expected_s``
        (0: unknown)."""
        ident = threading.get_ident()
        bound_s = max(self.timeout_s, SLOWER * expected_s)
        with self._lock:
            self._running[ident] = (self._clock(), bound_s)
            self._longest_bound_s = max(self._longest_bound_s, bound_s)
        try:
            yield
        finally:
            with self._lock:
                del self._running[ident]

    def running_for(self) -> float:
        """Seconds the longest-running pass has run so far (0 with none running)."""
        with self._lock:
            oldest = min((started for started, _ in self._running.values()), default=None)
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest)

    def check(self) -> bool:
        """Whether a pass has run past its bound (then ``on_hang`` has been called)."""
        now = self._clock()
        with self._lock:
            overdue = [(now - s, bound) for s, bound in self._running.values() if now - s >= bound]
        if not overdue:
            return False
        faulthandler.cancel_dump_traceback_later()  # ``on_hang`` takes its time to end
        self._on_hang(*max(overdue))
        return True

    def frozen_after_s(self) -> float:
        """How long the watch may go without running before the process ends."""
        with self._lock:
            return max(MIN_FROZEN_S, FROZEN_AFTER * self._longest_bound_s + self._poll_s)

    def start(self) -> None:
        """Look every ``poll_s`` on a thread of its own, until ``close`` or a hang."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="batchfit-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _watch(self) -> None:
        stderr = _stderr_file()
        try:
            while True:
                if stderr is not None:
                    faulthandler.dump_traceback_later(self.frozen_after_s(), exit=True, file=stderr)
                if self._stop.wait(self._poll_s) or self.check():
                    return
        finally:
            if stderr is not None:
                faulthandler.cancel_dump_traceback_later()


def _stderr_file() -> Any:
    """Standard error as faulthandler writes to it (a file with a descriptor): the process's
    own where ``sys.stderr`` was replaced by an object without one (captured in a test, a
    notebook); None, with a warning, where there is none at all."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()  # type: ignore[union-attr]
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation among them
            continue
        return stream
    log.warning("no standard error to write stacks to: a pass that holds the GIL for ever "
                "is not noticed")  # fmt: skip
    return None


def report_hang(
    running_s: float, bound_s: float, timeout_s: float, then: str, *,
    option: str = "--forward-timeout-s",
) -> None:  # fmt: skip
    """Log a hung pass (``option``: the name of ``timeout_s``; ``then``: what happens next),
    then write every thread's stack to standard error (the hung pass's frames among them)."""
    if bound_s > timeout_s:
        past = f"{SLOWER:g} times as long as the passes so far predict ({bound_s:.0f}s)"
    else:
        past = f"{option} {timeout_s:g}"
    log.error(
        "a forward pass has run for %.0fs, past %s: the device or the model hangs; every "
        "thread's stack follows, then %s", running_s, past, then,
    )  # fmt: skip
    faulthandler.dump_traceback(all_threads=True)
