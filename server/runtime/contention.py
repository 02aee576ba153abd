"""Fewer intra-op threads while the host's CPUs are taken by something else, where that
proves faster.

With every CPU in torch's pool, each parallel step of a forward pass waits for all of its
threads. While other work holds a CPU (a neighbour, the load generator, the event loop at
its busiest), one of them is off a CPU at many steps and the rest wait for it: measured on
2 vCPUs with one CPU held by a busy loop, a lone all-MiniLM-L6-v2 input took 43 ms on two
threads against 29 ms on one, and the model thread waited for a CPU 37% of the time (0.2%
on a quiet host); a batch of 32 inputs still ran 5% faster on two. So the model thread
times its own wait for a CPU in every pass (its ``schedstat``'s run delay);
where the host is busy it runs a while on one thread, and keeps whichever ran more padded
tokens a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from batching.procfs import OpenFiles

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from batching import Forward

log = logging.getLogger("batchfit")


class RunDelay:
    """The calling thread's total wait for a CPU so far, in seconds (the second field of
    its ``schedstat``), from a file opened once per thread."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._files = OpenFiles()

    def __call__(self) -> float:
        # NOTE: by thread id, not /proc/thread-self: a descriptor kept for one thread must
        # not answer for another.
        path = f"{self._proc}/self/task/{threading.get_native_id()}/schedstat"
        return int(self._files.read(path).split()[1]) / 1e9


class ThreadGuard:
    """Chooses, before each forward pass on the model thread, between ``num_threads`` and
    one thread (``set_threads`` applies it, on that thread).

    While passes on every thread wait for a CPU ``busy_share`` of their wall time or more
    (over ``window_s`` of passes), the next ``window_s`` of passes run on one thread. Where
    one thread got through more padded tokens per second of pass than every thread did, the
    passes stay on one thread for ``hold_s``, then try every thread again; where it did not
    (a batch large enough to gain from every thread even on a busy host), they go back to
    every thread and try one again no sooner than ``hold_s`` later. Passes shorter than
    ``min_pass_s`` are not counted: they say little about torch's threads."""

    def __init__(
        self, num_threads: int, set_threads: Callable[[int], None], *,
        run_delay: Callable[[], float] | None = None, clock: Callable[[], float] = time.monotonic,
        window_s: float = 0.5, busy_share: float = 0.15, hold_s: float = 10.0,
        min_pass_s: float = 0.001, gauge: Gauge | None = None, judging: bool = True,
    ) -> None:  # fmt: skip
        if num_threads < 2:
            raise ValueError(f"a guard needs 2 threads or more to fall back from: {num_threads}")
        self.num_threads = num_threads
        self.threads = num_threads
        """The intra-op threads the next pass runs on."""
        self._set_threads = set_threads
        self._run_delay = run_delay if run_delay is not None else RunDelay()
        self._clock = clock
        self._window_s = window_s
        self._busy_share = busy_share
        self._hold_s = hold_s
        self._min_pass_s = min_pass_s
        self._gauge = gauge
        self._window = _Window()
        self._busy = 0.0  # the share of the last busy window on every thread spent waiting
        self._all_speed = 0.0  # and its padded tokens per second of pass
        self._until: float | None = None  # the current choice holds until then
        self._trying_one = False
        self._disabled = False
        self._light = False  # the last pass was shorter than min_pass_s
        self._interrupted = False  # passes side by side ran since the last pass alone
        self.judging = judging
        """Whether passes are timed and judged; until then every one runs on every thread
        (``begin``)."""
        self.num_fallbacks = 0
        """How often one thread proved faster and the passes stayed on it."""
        if gauge is not None:
            gauge.set(num_threads)

    def wrap(self, forward: Forward) -> Forward:
        def guarded_forward(items: Sequence[Any]) -> list[Any]:
            if self._disabled or not self.judging:
                return forward(items)
            self._before()
            if self._until is not None:
                # A choice holds: nothing a pass shows is judged before it ends, so the
                # passes meanwhile run untimed (two file reads fewer on a lone request's way).
                return forward(items)
            # NOTE: after a pass too short to count, the next is only timed: a model that
            # does almost no work pays two clock reads a pass, not two file reads.
            measured = not self._light
            delay = self._read() if measured else 0.0
            started = self._clock()
            try:
                return forward(items)
            finally:
                wall_s = self._clock() - started
                self._light = wall_s < self._min_pass_s
                if measured and not self._light and not self._disabled:
                    delay = self._read() - delay
                    if not self._disabled:
                        tokens = len(items) * max((getattr(i, "cost", 1) for i in items),
                                                  default=0)  # fmt: skip
                        self._after(wall_s, delay, tokens)

        return guarded_forward

    def begin(self) -> None:
        """Judge the passes from the next on (a replica begins once it is warmed up: warm-up's
        calibration batches grow from one shape to the next, so two windows of them do not
        compare, and a host busy starting its replicas is not the one they will serve on. A
        decision taken on them held one thread for 10 s of lone requests 30% slower than on
        two)."""
        self.judging = True

    def interrupt(self) -> None:
        """Passes ran side by side (``batching/side.py``), on other threads or this one: from
        any thread. The next guarded pass runs on every thread, its windows and any trial
        dropped, and no new trial for ``hold_s``: passes alone timed during a busy spell and
        after it do not compare (a guard that had just tried one thread on the spell's last
        passes kept it for the idle client that followed: 18 against 13 ms a request)."""
        self._interrupted = True

    def _read(self) -> float:
        try:
            return self._run_delay()
        except (OSError, ValueError, IndexError) as exc:
            self._disabled = True
            log.warning("cannot read this thread's wait for a CPU (%s); the model keeps "
                        "%d threads whatever the host's load", exc, self.num_threads)  # fmt: skip
            if self.threads != self.num_threads:
                self._use(self.num_threads)
            return 0.0

    def _before(self) -> None:
        if self._interrupted:
            self._interrupted = False
            self._trying_one, self._window = False, _Window()
            self._until = self._clock() + self._hold_s  # no trial on the spell's leftovers
            if self.threads != self.num_threads:
                self._use(self.num_threads)
            return
        if self._until is not None and self._clock() >= self._until:
            self._until = None
            self._window = _Window()
            if self.threads == 1:
                self._use(self.num_threads)

    def _after(self, wall_s: float, delay_s: float, tokens: int) -> None:
        window = self._window
        window.add(wall_s, delay_s, tokens)
        if window.wall_s < self._window_s:
            return
        self._window = _Window()
        if self._trying_one:
            self._trying_one = False
            faster = window.speed > self._all_speed
            if faster:
                self.num_fallbacks += 1
                (log.debug if self.num_fallbacks > 1 else log.info)(
                    "other work holds the host's CPUs: forward passes on %d threads waited "
                    "for one %.0f%% of the time, and one thread ran %.0f%% more tokens a "
                    "second; one thread for %.0f s", self.num_threads, self._busy * 100,
                    (window.speed / max(self._all_speed, 1e-9) - 1) * 100, self._hold_s,
                )  # fmt: skip
            else:
                log.debug("one thread ran %.0f%% fewer tokens a second than %d; back to %d "
                          "for %.0f s", (1 - window.speed / max(self._all_speed, 1e-9)) * 100,
                          self.num_threads, self.num_threads, self._hold_s)  # fmt: skip
                self._use(self.num_threads)
            self._until = self._clock() + self._hold_s
            return
        if self._until is not None:
            return  # the last choice holds
        share = window.delay_s / window.wall_s
        if share >= self._busy_share:
            self._busy, self._all_speed = share, window.speed
            log.debug("forward passes on %d threads waited for a CPU %.0f%% of the time; "
                      "trying one thread", self.num_threads, share * 100)  # fmt: skip
            self._trying_one = True
            self._use(1)

    def _use(self, threads: int) -> None:
        self._set_threads(threads)
        self.threads = threads
        if self._gauge is not None:
            self._gauge.set(threads)


class _Window:
    """Passes since a window began: their wall time, wait for a CPU and padded tokens."""

    __slots__ = ("delay_s", "tokens", "wall_s")

    def __init__(self) -> None:
        self.wall_s = self.delay_s = 0.0
        self.tokens = 0

    def add(self, wall_s: float, delay_s: float, tokens: int) -> None:
        self.wall_s += wall_s
        self.delay_s += delay_s
        self.tokens += tokens

    @property
    def speed(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0
