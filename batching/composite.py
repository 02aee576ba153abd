"""Several memory probes read as one: the smallest free memory any of them reports, and a
probe that fails retried with backoff while its last reading stands in for it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from .probes import HostProbe, MemoryProbe, MemoryReading, NvmlProbe, ProbeError, TorchCudaProbe

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _ProbeState:
    """One probe of a ``CompositeProbe``: its last good reading, and while it fails, when to
    try it again."""

    probe: MemoryProbe
    last: MemoryReading | None = None
    failing_since_s: float | None = None
    retry_at_s: float = 0.0
    backoff_s: float = 0.0


class CompositeProbe:
    """Reads every probe; free is the smallest any of them reports. Peaks come from the first
    probe that measures them.

    A probe that fails is retried with backoff (``retry_initial_s``, doubling up to
    ``retry_max_s``) rather than given up on: a file that could not be read once, or a driver
    call that failed, says nothing about the next one. Meanwhile its last good reading stands
    in for it, so the budget still has the memory it last saw (and the sizer's ceiling, proven
    at warm-up) to go by; the reading names it in ``failing``. It is logged once when it fails
    and once when it reads again."""

    name = "composite"

    def __init__(
        self,
        probes: list[MemoryProbe],
        *,
        clock: Callable[[], float] = time.monotonic,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 60.0,
    ) -> None:
        self._states = [_ProbeState(probe) for probe in probes]
        self._clock = clock
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        # NOTE: read() runs on the event loop, start_batch() and batch_peak() on the model
        # thread: a probe's state changes under this lock.
        self._lock = threading.Lock()
        self._peak_state: _ProbeState | None = None

    @property
    def probes(self) -> list[MemoryProbe]:
        return [state.probe for state in self._states]

    def read(self) -> MemoryReading:
        merged: MemoryReading | None = None
        failing = []
        now = self._clock()
        for state in self._states:
            reading = None
            if state.failing_since_s is None or now >= state.retry_at_s:
                try:
                    reading = state.probe.read()
                except ProbeError as exc:
                    self._failed(state, exc, now)
                else:
                    self._recovered(state, now)
                    state.last = reading
            if reading is None:
                failing.append(state.probe.name)
                if state.last is not None:
                    reading = replace(state.last, sources=())
            if reading is not None:
                # NOTE: the first as it is (what merging it into an empty reading gives): a
                # CPU host's one probe, read after batches, comes through uncopied.
                merged = reading if merged is None else _merge(merged, reading)
        if merged is None:
            return MemoryReading(failing=tuple(failing))
        if failing or merged.failing:
            return replace(merged, failing=tuple(failing))
        return merged

    def _failed(self, state: _ProbeState, exc: ProbeError, now: float) -> None:
        with self._lock:
            if state.failing_since_s is None:
                state.failing_since_s = now
                state.backoff_s = self._retry_initial_s
                fallback = "its last reading" if state.last is not None else "no reading of it"
                log.warning(
                    "memory probe %s failed: %s; retrying every %gs up to %gs, with %s and the "
                    "proven ceiling meanwhile", state.probe.name, exc, state.backoff_s,
                    self._retry_max_s, fallback,
                )  # fmt: skip
            else:
                state.backoff_s = min(self._retry_max_s, 2 * state.backoff_s)
            state.retry_at_s = now + state.backoff_s

    def _recovered(self, state: _ProbeState, now: float) -> None:
        with self._lock:
            if state.failing_since_s is not None:
                log.warning(
                    "memory probe %s reads again after %.0fs in error",
                    state.probe.name, now - state.failing_since_s,
                )  # fmt: skip
                state.failing_since_s = None

    def start_batch(self) -> int | None:
        self._peak_state = None
        for state in self._states:
            if state.failing_since_s is not None:
                continue
            try:
                baseline = state.probe.start_batch()
            except ProbeError as exc:
                self._failed(state, exc, self._clock())
                continue
            if baseline is not None:
                self._peak_state = state
                return baseline
        return None

    def batch_peak(self) -> int | None:
        """The peak from the probe that gave the baseline (same scale), if it still reads."""
        state = self._peak_state
        if state is None or state.failing_since_s is not None:
            return None
        try:
            return state.probe.batch_peak()
        except ProbeError as exc:
            self._failed(state, exc, self._clock())
            return None

    def release_cache(self) -> None:
        for probe in self.probes:
            release = getattr(probe, "release_cache", None)
            if release is not None:
                release()

    def settle(self) -> None:
        for probe in self.probes:
            settle = getattr(probe, "settle", None)
            if settle is not None:
                settle()


def _merge(a: MemoryReading, b: MemoryReading) -> MemoryReading:
    free, limit = (b.free_bytes, b.limit) if a.free_bytes is None else (a.free_bytes, a.limit)
    if a.free_bytes is not None and b.free_bytes is not None and b.free_bytes < a.free_bytes:
        free, limit = b.free_bytes, b.limit
    values = {
        name: getattr(a, name) if getattr(a, name) is not None else getattr(b, name)
        for name in ("used_bytes", "device_used_bytes", "device_total_bytes",
                     "allocated_bytes", "reserved_bytes", "resident_bytes",
                     "resident_peak_bytes")
    }  # fmt: skip
    enforced, enforced_free = a.enforced, a.enforced_free_bytes
    if b.enforced_free_bytes is not None and (
        enforced_free is None or b.enforced_free_bytes < enforced_free
    ):
        enforced, enforced_free = b.enforced, b.enforced_free_bytes
    shared = a.shared_device
    if b.shared_device is not None:
        shared = bool(a.shared_device) or b.shared_device
    return replace(
        a, free_bytes=free, limit=limit, sources=a.sources + b.sources, enforced=enforced,
        enforced_free_bytes=enforced_free, shared_device=shared, **values,
    )  # fmt: skip


def probes_for_device(device: str, *, memory_limit_bytes: int | None = None) -> CompositeProbe:
    """NVML and torch.cuda on a CUDA device, the host probe on CPU."""
    probes: list[MemoryProbe] = []
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        for make in (
            lambda: TorchCudaProbe(device, memory_limit_bytes=memory_limit_bytes),
            lambda: NvmlProbe(index),
        ):
            try:
                probes.append(make())
            except (ProbeError, ImportError) as exc:
                log.warning("memory probe unavailable: %s", exc)
    else:
        probes.append(HostProbe(memory_limit_bytes=memory_limit_bytes))
    return CompositeProbe(probes)
