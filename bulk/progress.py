"""How far a job is: a live bar on a terminal, a log line now and then elsewhere, a summary.

The bar shows inputs done of the total, inputs/s and tokens/s (over this run's computed
inputs, skipped parts left out), the time left at that rate and the budget of the current
batches.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from batching import BatchBudget

log = logging.getLogger("batchfit.bulk")

MiB = 2**20
BAR_WIDTH = 24


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def size(num_bytes: float | None) -> str:
    if num_bytes is None or num_bytes == float("inf"):
        return "no memory cap"
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.1f} GiB"
    return f"{num_bytes / MiB:.0f} MiB"


def describe_budget(budget: BatchBudget | None) -> str:
    if budget is None:
        return "-"
    return f"{budget.max_items} x {budget.max_tokens:,} tokens, {size(budget.max_bytes)}"


@dataclass
class Snapshot:
    done: int
    total: int | None
    computed: int
    tokens: int
    elapsed_s: float
    budget: BatchBudget | None

    @property
    def inputs_per_s(self) -> float:
        return self.computed / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.total is None or not self.inputs_per_s:
            return None
        return max(0, self.total - self.done) / self.inputs_per_s


class Progress:
    """Counts rows done (computed, rejected or skipped) against the total; draws a bar on a
    terminal every ``redraw_s``, else logs a line every ``log_every_s``."""

    def __init__(
        self, *, stream: TextIO | None = None, terminal: bool | None = None,
        log_every_s: float = 30.0, redraw_s: float = 0.25, clock=time.monotonic,
    ) -> None:  # fmt: skip
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.log_every_s = log_every_s
        self.redraw_s = redraw_s
        self.clock = clock
        self.total: int | None = None
        self.done = 0
        self.computed = 0
        self.tokens = 0
        self.budget: BatchBudget | None = None
        self._started: float | None = None
        self._last_shown = clock()
        self._lock = threading.Lock()
        self._drawn = False

    def set_total(self, total: int) -> None:
        with self._lock:
            self.total = total

    def rows(self, count: int) -> None:
        """``count`` rows are done without running (bad rows, skipped parts)."""
        with self._lock:
            self.done += count
        self._maybe_show()

    def batch(self, inputs: int, tokens: int, budget: BatchBudget | None = None) -> None:
        with self._lock:
            if self._started is None:
                self._started = self.clock()
            self.done += inputs
            self.computed += inputs
            self.tokens += tokens
            if budget is not None:
                self.budget = budget
        self._maybe_show()

    def start_computing(self) -> None:
        """Rates count from here (after loading and warm-up)."""
        with self._lock:
            self._started = self.clock()

    def snapshot(self) -> Snapshot:
        with self._lock:
            elapsed = self.clock() - self._started if self._started is not None else 0.0
            return Snapshot(self.done, self.total, self.computed, self.tokens, elapsed, self.budget)

    def _maybe_show(self) -> None:
        now = self.clock()
        every = self.redraw_s if self.terminal else self.log_every_s
        if now - self._last_shown < every:
            return
        self._last_shown = now
        self.show()

    def show(self) -> None:
        snapshot = self.snapshot()
        if self.terminal:
            self.stream.write("\r" + bar_line(snapshot) + "\x1b[K")
            self.stream.flush()
            self._drawn = True
        else:
            log.info("progress: %s", log_line(snapshot))

    def close(self) -> None:
        """End the bar's line, so what follows starts on its own."""
        if self.terminal and self._drawn:
            self.show()
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def bar_line(s: Snapshot) -> str:
    if s.total:
        fraction = min(1.0, s.done / s.total)
        filled = round(fraction * BAR_WIDTH)
        head = f"{fraction:4.0%} |{'█' * filled}{' ' * (BAR_WIDTH - filled)}| "
        count = f"{s.done:,}/{s.total:,}"
    else:
        head, count = "", f"{s.done:,}"
    eta = s.eta_s
    return (
        f"{head}{count} inputs  {s.inputs_per_s:,.1f} inputs/s  {s.tokens_per_s:,.0f} tokens/s"
        f"  ETA {duration(eta) if eta is not None else '-'}  budget {describe_budget(s.budget)}"
    )


def log_line(s: Snapshot) -> str:
    of = f" of {s.total:,} ({s.done / s.total:.1%})" if s.total else ""
    eta = s.eta_s
    return (
        f"{s.done:,}{of} inputs, {s.inputs_per_s:,.1f} inputs/s, {s.tokens_per_s:,.0f} tokens/s,"
        f" ETA {duration(eta) if eta is not None else '-'}, batch budget "
        f"{describe_budget(s.budget)}"
    )


class BarAwareHandler(logging.StreamHandler):
    """Writes log records on the progress bar's stream without garbling it: the bar's line is
    cleared first and drawn again after."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(progress.stream)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        drawn = self.progress.terminal and self.progress._drawn
        if drawn:
            self.stream.write("\r\x1b[K")
        super().emit(record)
        if drawn:
            self.progress.show()
