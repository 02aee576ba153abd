"""On-demand torch.profiler traces of the next N batches, recorded on the model thread.

torch is imported when a trace starts: the admin routes of an API process (which never
imports torch) read ``ProfilerBusy`` and ``ProfileStatus`` from here."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.profiler import profile

log = logging.getLogger(__name__)

Forward = Callable[[Sequence[Any]], list[Any]]


class ProfilerBusy(Exception):
    """A trace is already armed or recording."""


@dataclass(frozen=True, slots=True)
class ProfileStatus:
    state: str  # "idle", "armed" (waiting for the next batch) or "recording"
    num_batches: int
    batches_recorded: int
    trace_path: str | None
    last_trace_path: str | None
    last_error: str | None


class BatchProfiler:
    """Arm from any thread; ``wrap(forward)`` does all the profiling inside the forward calls,
    so the profiler starts, records and stops on the model thread and never on the event loop.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._num_batches = 0
        self._recorded = 0
        self._path: Path | None = None
        self._last_path: Path | None = None
        self._last_error: str | None = None
        self._profile: profile | None = None

    def arm(self, num_batches: int) -> Path:
        """Record the next ``num_batches`` batches; return where the trace will be written."""
        if num_batches < 1:
            raise ValueError(f"num_batches must be at least 1, not {num_batches}")
        with self._lock:
            if self._path is not None:
                raise ProfilerBusy(
                    f"a trace of {self._num_batches} batches is already "
                    f"{'recording' if self._profile else 'armed'} ({self._path})"
                )
            self.directory.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            name = f"batchfit-trace-{stamp}-{os.getpid()}-{time.time_ns() % 10**9}.json"
            self._path = self.directory / name
            self._num_batches = num_batches
            self._recorded = 0
            return self._path

    def status(self) -> ProfileStatus:
        with self._lock:
            if self._path is None:
                state = "idle"
            else:
                state = "recording" if self._profile is not None else "armed"
            return ProfileStatus(
                state=state,
                num_batches=self._num_batches,
                batches_recorded=self._recorded,
                trace_path=str(self._path) if self._path else None,
                last_trace_path=str(self._last_path) if self._last_path else None,
                last_error=self._last_error,
            )

    def wrap(self, forward: Forward) -> Forward:
        def profiled_forward(items: Sequence[Any]) -> list[Any]:
            with self._lock:
                armed = self._path is not None
            if not armed:
                return forward(items)
            if self._profile is None:
                self._start()
            max_cost = max((getattr(item, "cost", 0) for item in items), default=0)
            from torch.profiler import record_function

            try:
                with record_function(f"batchfit_batch[{len(items)}x{max_cost}]"):
                    return forward(items)
            finally:
                self._after_batch()

        return profiled_forward

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if _cuda_in_use():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        prof.start()
        with self._lock:
            self._profile = prof

    def finish(self) -> None:
        """At shutdown, on the model thread: write a recording that has not reached its batch
        count with the batches it has, or disarm one that never started. (A profiler left
        recording when the interpreter exits crashes it.)"""
        with self._lock:
            if self._path is None:
                return
            if self._profile is None:
                self._path = None
                return
            prof, path = self._profile, self._path
        self._write(prof, path)

    def _after_batch(self) -> None:
        with self._lock:
            self._recorded += 1
            if self._recorded < self._num_batches:
                return
            prof, path = self._profile, self._path
        assert prof is not None and path is not None
        self._write(prof, path)

    def _write(self, prof: profile, path: Path) -> None:
        error = None
        try:
            if _cuda_in_use():
                import torch

                torch.cuda.synchronize()
            prof.stop()
            partial = path.with_suffix(".partial")
            prof.export_chrome_trace(str(partial))
            partial.replace(path)
            log.info("wrote a profile of %d batches to %s", self._recorded, path)
        except Exception as exc:  # a failed export must not fail the batch it followed
            error = f"{type(exc).__name__}: {exc}"
            log.exception("could not write the profile trace %s", path)
        with self._lock:
            self._profile = None
            self._last_path = None if error else path
            self._last_error = error
            self._path = None


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()
