"""The batcher's view of memory: the latest reading, and the measurement around each batch.

The model thread measures each batch's peak and, at most every ``min_interval_s``, reads
memory for the next batch's budget, right after the forward pass: the probe's file reads and
device queries stay off the event loop. With ``max_share``, the interval also grows with what
a reading costs, so that readings take at most that share of the model thread's time, up to
half of ``max_age_s``. The event loop reads anew only where the latest reading is older than
``max_age_s``. Every reading is published as gauges.

With ``max_share``, the per-batch measurement (the baseline before a batch, its peak after)
is skipped where it would cost more than that share of the model's forward passes and a
batch at least as large, in items and in padded length, was measured within half of
``max_age_s`` (``_ShapeWatch``): on a host probe it reads ``/proc`` twice and writes once,
about 40 us in a tight loop and twice that in a serving process, against a forward pass of
milliseconds for a real model on a CPU, but more than a model that does no work takes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Sequence, Sized
from typing import Any

from .clock import Clock
from .measure import Forward, forward_from_baseline, measured_forward, peak_above
from .metrics import MemoryMetrics
from .probes import MemoryProbe, MemoryReading

log = logging.getLogger(__name__)

_COST_WEIGHT = 0.2
"""The newest reading's weight in ``MemoryWatch.reading_cost_s`` (a moving average)."""

Measurement = tuple[int | None, MemoryReading | None]
"""A batch's peak memory above its baseline, and a reading taken after it (or None)."""
Answer = tuple[list[Any], Measurement | None]
"""A batch's outputs, with its measurement where it came back with them."""

_ANSWER_TURNS = 8
"""How many turns of the event loop a measurement after a batch's outputs waits, at most,
for the requests they settled to be answered (``MemoryWatch.measurement``)."""
_GATE_TIMEOUT_S = 1.0
"""How long the model thread waits for its gate at most: a safety net (the batcher opens it
on every path)."""


def closed_gate() -> threading.Lock:
    """A gate the model thread waits at (``acquire``, without the interpreter lock) until the
    event loop opens it (``open_gate``): a lock held from the start. (A ``threading.Event``
    took 16 us to make with the CPU's caches cold, on a lone request's way.)"""
    gate = threading.Lock()
    gate.acquire()
    return gate


def open_gate(gate: threading.Lock) -> None:
    """Open ``gate``; from the event loop only (the model thread only takes it), so opening
    it again is harmless."""
    if gate.locked():
        gate.release()


class _ShapeWatch:
    """One model's recent batches as the per-batch measurement sees them (model thread only):
    its latest forward pass's duration, and the shapes measured lately."""

    __slots__ = ("forward_s", "measured")

    def __init__(self) -> None:
        self.forward_s: float | None = None
        self.measured: list[tuple[int, int, float]] = []
        """(items, padded length, when) of the batches measured lately."""

    def covered(self, num_items: int, padded_len: int, now: float, window_s: float) -> bool:
        """Whether a batch at least this large was measured within ``window_s``."""
        self.measured = [m for m in self.measured if now - m[2] <= window_s]
        return any(n >= num_items and length >= padded_len for n, length, _ in self.measured)

    def note(self, num_items: int, padded_len: int, now: float) -> None:
        """A batch of this shape was measured at ``now``."""
        self.measured = [m for m in self.measured if not (num_items >= m[0] and padded_len >= m[1])]
        self.measured.append((num_items, padded_len, now))


class MemoryWatch:
    """The latest memory reading and its age, as one batcher keeps them."""

    def __init__(
        self, probe: MemoryProbe | None, *, clock: Clock, metrics: MemoryMetrics | None,
        oom_errors: tuple[type[BaseException], ...], max_age_s: float, min_interval_s: float,
        max_share: float | None = None,
    ) -> None:  # fmt: skip
        self.probe = probe
        self._clock = clock
        self._metrics = metrics
        self._oom_errors = oom_errors
        self._max_age_s = max_age_s
        self._min_interval_s = min_interval_s
        self._max_share = max_share
        self.reading_cost_s: float | None = None
        """How long a reading takes, averaged over the recent ones (None: none taken yet)."""
        self._reading: MemoryReading | None = None
        self._reading_s = 0.0
        self.num_loop_readings = 0
        """Memory readings taken on the event loop (the rest come with a batch's results)."""
        self.measure_cost_s: float | None = None
        """How long a batch's measurement (baseline and peak) takes, averaged lately."""
        self.num_unmeasured = 0
        """Batches run without a measurement (model thread; see ``_measures``)."""
        self._shapes: dict[Forward, _ShapeWatch] = {}

    def latest(self) -> MemoryReading | None:
        """The latest reading (most often the one that came back with the last batch) if it
        is recent enough, else one read now, on the event loop."""
        if self.probe is None:
            return None
        reading = self._reading
        if reading is not None and self._clock.now() - self._reading_s <= self._max_age_s:
            return reading
        self.num_loop_readings += 1
        reading = self._read(self.probe)
        self.keep(reading, self._clock.now())
        return reading

    def interval_s(self) -> float:
        """How old the latest reading must be before the model thread reads again."""
        cost, share = self.reading_cost_s, self._max_share
        if cost is None or not share:
            return self._min_interval_s
        return max(self._min_interval_s, min(cost / share, self._max_age_s / 2))

    def _read(self, probe: MemoryProbe) -> MemoryReading:
        """``probe.read()``, its duration folded into ``reading_cost_s``."""
        started = self._clock.now()
        reading = probe.read()
        took = self._clock.now() - started
        cost = self.reading_cost_s
        self.reading_cost_s = took if cost is None else cost + _COST_WEIGHT * (took - cost)
        return reading

    def forget(self) -> None:
        """The next batch reads anew (what a failed batch left), and every batch is
        measured until its shape has been again."""
        self._reading = None
        self._shapes = {}  # NOTE: the model thread's, replaced whole between two batches

    def keep(self, reading: MemoryReading | None, taken_s: float) -> None:
        """Make ``reading`` (taken at ``taken_s``) the latest and publish it; None: keep the
        latest."""
        if reading is None:
            return
        self._reading, self._reading_s = reading, taken_s
        metrics = self._metrics
        if metrics is None:
            return
        for gauge, value in (
            (metrics.free_bytes, reading.free_bytes),
            (metrics.device_used, reading.device_used_bytes),
            (metrics.device_total, reading.device_total_bytes),
            (metrics.torch_allocated, reading.allocated_bytes),
            (metrics.torch_reserved, reading.reserved_bytes),
            (metrics.host_resident, reading.resident_bytes),
            (metrics.host_resident_peak, reading.resident_peak_bytes),
            (metrics.host_available, None if reading.device_total_bytes else reading.free_bytes),
        ):
            if value is not None:
                gauge.set(value)
        metrics.set_limit(reading.limit)
        metrics.set_probe_states(reading)

    def calibration_forward(
        self, forward: Forward, items: Sequence[Any]
    ) -> tuple[list[Any], int | None]:
        """Runs on the model thread: a calibration batch, memory settled first, and its
        peak (``measured_forward``)."""
        return measured_forward(
            forward, items, probe=self.probe, oom_errors=self._oom_errors, settle=True
        )

    def unmeasured(self, forward: Forward, items: Sequence[Any]) -> list[Any]:
        """Runs on a model thread: a pass beside others, whose peak is the whole process's
        and not its own (after an OOM error the probe still releases its cache)."""
        return forward_from_baseline(
            forward, items, probe=self.probe, oom_errors=self._oom_errors, measure=False
        )[0]

    def forward(
        self, forward: Forward, items: Sequence[Any], waiting: Sized,
        gate: threading.Lock | None = None,
    ) -> tuple[Answer, Callable[[], Measurement] | None]:  # fmt: skip
        """Runs on the model thread (``ModelThread.call_then``): the forward pass, then its
        measurement (``_measure``). Where work waits (``waiting`` is not empty), or there is
        nothing to measure (an unmeasured batch, no reading due), the measurement goes back
        with the outputs, so that the next batch is planned from it at once. Where none
        waits, the outputs go back first and the measurement follows: taken just after a
        forward pass, with the caches cold, a reading cost a lone all-MiniLM-L6-v2 request
        about 0.4 ms on a 2-CPU host, and the peak's one file read alone 70 to 100 us. (A
        batch is measured only where its pass is long enough, or its shape new: a second
        hand-back after a short pass cost more than it saved.) A measurement that follows
        waits for ``gate`` to open, where given (``measurement``)."""
        shapes = self._shapes.get(forward)
        if shapes is None:
            shapes = self._shapes[forward] = _ShapeWatch()
        num_items, padded_len = len(items), max((item.cost for item in items), default=0)
        clock = self._clock
        started = clock.now()
        outputs, baseline = forward_from_baseline(
            forward, items, probe=self.probe, oom_errors=self._oom_errors,
            measure=self._measures(shapes, num_items, padded_len, started),
        )  # fmt: skip
        ended = clock.now()
        shapes.forward_s = ended - started  # the baseline's read included, where taken
        if baseline is not None:
            shapes.note(num_items, padded_len, started)
        else:
            self.num_unmeasured += 1
        # NOTE: the event loop set these before this batch, and leaves them until it returns.
        due = self._reading is None or ended - self._reading_s >= self.interval_s()
        measure = functools.partial(self._measure, baseline, due)
        # NOTE: ``waiting`` (the queue) is the event loop's, its length read from the model
        # thread: a stale one only changes which of the two goes back first.
        if len(waiting) or (baseline is None and not due):
            return (outputs, measure()), None
        if gate is None:
            return (outputs, None), measure

        def measure_once_open() -> Measurement:
            gate.acquire(timeout=_GATE_TIMEOUT_S)
            return measure()

        return (outputs, None), measure_once_open

    def _measures(self, shapes: _ShapeWatch, num_items: int, padded_len: int, now: float) -> bool:
        """Runs on the model thread, before a batch: whether to measure it. Always, unless
        ``max_share`` is set, the measurement costs more than that share of the model's
        latest forward pass, and a batch at least as large was measured within half of
        ``max_age_s`` (so a lone reading of a skipped shape is never older than that)."""
        share, cost, forward_s = self._max_share, self.measure_cost_s, shapes.forward_s
        if self.probe is None or not share or cost is None or forward_s is None:
            return True
        if cost <= share * forward_s:
            return True
        return not shapes.covered(num_items, padded_len, now, self._max_age_s / 2)

    def _measure(self, baseline: int | None, read: bool) -> Measurement:
        """Runs on the model thread, after a batch: its peak memory above ``baseline`` and,
        with ``read``, a memory reading for the next batch's budget."""
        probe = self.probe
        peak_s = self._clock.now()
        peak = peak_above(probe, baseline)
        if baseline is not None:
            # NOTE: timed on its second half, one file read; the first (the baseline) reads
            # the same file and resets the peak.
            took = 2 * (self._clock.now() - peak_s)
            cost = self.measure_cost_s
            self.measure_cost_s = took if cost is None else cost + _COST_WEIGHT * (took - cost)
        return peak, self._read(probe) if probe is not None and read else None

    @staticmethod
    async def measurement(
        later: asyncio.Future[Measurement | None], gate: threading.Lock,
        answered: Callable[[], bool] | None, waiting: Sized,
    ) -> Measurement:  # fmt: skip
        """The measurement that follows a batch's outputs; none where it failed. Its
        ``gate`` opens once ``answered()`` says the requests the outputs settled have their
        answers, work waits (``waiting``), or after a few turns of the loop: measuring beside
        the event loop, the model thread holds the interpreter lock the answers need (a lone
        all-MiniLM-L6-v2 request on a 2-CPU host was answered 110 us later)."""
        try:
            for _ in range(_ANSWER_TURNS):
                if answered is None or answered() or len(waiting):
                    break
                await asyncio.sleep(0)
        finally:
            open_gate(gate)
        try:
            return await later or (None, None)
        except Exception:
            log.exception("reading memory after a batch failed")
            return None, None
