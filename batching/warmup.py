"""Warm-up: the largest batches the sizer would plan, run before any real one.

A pure decision of which synthetic batch runs next, driven by whoever owns the model thread
(the server's batcher, a bulk job's runner): ``next_batch`` with what is free now, then
``ran`` or ``out_of_memory``, until ``next_batch`` returns None, then ``finish``.
"""

from __future__ import annotations

import logging

from .planner import largest_batch
from .probes import MemoryReading
from .sizer import AdaptiveSizer, BatchOutcome, Sizer

log = logging.getLogger("batchfit")


class WarmUp:
    """For a short length and the longest one: the largest batch the budget allows (at most
    ``max_items``), lowering the cap after each OOM until one passes, so nothing starts with
    a budget it cannot run. The adaptive sizer calibrates its memory model on each batch that
    ran. A fixed sizer gets one batch of its own budget's shape."""

    def __init__(self, sizer: Sizer, *, max_input_tokens: int, max_items: int) -> None:
        self.sizer = sizer
        self.max_items = max_items
        self.adaptive = isinstance(sizer, AdaptiveSizer)
        if self.adaptive:
            self._lengths = sorted({min(max_input_tokens, 32), max_input_tokens})
        else:
            budget = sizer.budget()
            length = budget.max_tokens // budget.max_items
            self._lengths = [min(max_input_tokens, max(2, length))]
        self._start_length()
        self._current: tuple[int, int] | None = None
        self._scout = False

    def _start_length(self) -> None:
        self._cap = self.max_items
        self._scouted = False

    def _next_length(self) -> None:
        self._lengths.pop(0)
        self._start_length()

    def next_batch(self, reading: MemoryReading | None) -> tuple[int, int] | None:
        """``(num_items, length)`` of the next warm-up batch, or None when warm-up is done."""
        if not self._lengths:
            self._current = None
            return None
        length = self._lengths[0]
        fits = largest_batch(self.sizer.budget(reading), length)
        num_items = max(1, min(self._cap, fits))
        # NOTE: past a cgroup's limit (or the host's memory) the kernel kills the process: no
        # error comes back to lower the ceiling on. Where memory, not a cap, sets this batch's
        # size, a quarter of it runs first, so the full one is planned by a model corrected
        # at this length, not by the prior alone.
        self._scout = not self._scouted and fits < self._cap and num_items >= 4 and kills(reading)
        if self._scout:
            num_items //= 4
        self._current = (num_items, length)
        return self._current

    def ran(self, outcome: BatchOutcome) -> None:
        """The batch from ``next_batch`` ran cleanly."""
        assert self._current is not None
        if self.adaptive:
            self.sizer.calibrate(outcome)  # type: ignore[attr-defined]
        log.info(
            "warm-up batch of %d x %d tokens: %.3fs, peak %s",
            outcome.num_items, outcome.padded_len, outcome.elapsed_s,
            f"{outcome.peak_bytes / 2**20:.1f} MiB" if outcome.peak_bytes else "n/a",
        )  # fmt: skip
        if self._scout:
            self._scouted = True
        else:
            self._next_length()

    def out_of_memory(self) -> None:
        """The batch from ``next_batch`` ran out of memory."""
        assert self._current is not None
        num_items, length = self._current
        self.sizer.on_oom(num_items, length)
        if num_items == 1:
            log.warning("one input of %d tokens does not fit in memory", length)
            self._next_length()
            return
        log.info("warm-up batch of %d x %d ran out of memory", num_items, length)
        self._cap = num_items // 2  # a fixed sizer has no ceiling to lower

    def finish(self) -> None:
        """From now on the adaptive sizer's ceiling stays within what warm-up proved."""
        if not isinstance(self.sizer, AdaptiveSizer):
            return
        self.sizer.finish_warm_up()
        model = self.sizer.model
        ceiling = self.sizer.ceiling_bytes
        log.info(
            "memory model: %.0f bytes/token + %.1f bytes/token x length; ceiling %s",
            model.alpha, model.beta,
            "none" if ceiling == float("inf") else f"{ceiling / 2**20:.0f} MiB",
        )  # fmt: skip


def kills(reading: MemoryReading | None) -> bool:
    """Whether going past the binding limit gives no allocation error to lower the ceiling
    on: the kernel kills (cgroup, host memory), or nothing enforces it at its value
    (``--memory-limit`` is a promise: its address-space cap leaves room for thread stacks, so
    resident memory can pass it silently). The address space and a device fail an
    allocation instead."""
    return reading is not None and reading.limit is not None and reading.limit.source in (
        "cgroup", "host", "flag",
    )  # fmt: skip
