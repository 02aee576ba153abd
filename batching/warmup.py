"""Warm-up: which calibration batches run before any real one, and what the sizer learns.

``WarmUp`` is driven by whoever owns the model thread (the server's slot, a bulk job's
runner): ``next_batch`` with what is free now and the time spent, then ``ran`` or
``out_of_memory``, until ``next_batch`` returns None, then ``finish``. Nothing here awaits
or reads a clock. Its adaptive path is stepped by ``WarmUpPlanner``, a pure planner.

Warm-up climbs a ladder of lengths (32 tokens, then x4 up to the model's maximum), each at
the largest batch the memory budget read at that moment allows (capped by the item and
token caps; one input alone past the token cap, as serving runs it), until the ladder ends,
the next step is predicted to pass the time bound, or one input of the next length does not
fit. The longest length a batch ran at is the proven one; beyond it the fitted memory model
predicts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .planner import BatchBudget, largest_batch
from .probes import MemoryReading
from .sizer import AdaptiveSizer, BatchOutcome, Sizer

log = logging.getLogger("batchfit")

FIRST_LENGTH = 32
LENGTH_FACTOR = 4
WARMUP_BATCHES = 20
"""Default time bound, in full batches: 20 times the first full calibration batch (the
largest batch of short inputs the budget allows, as long as a served batch at the caps).
The lengths up to the token cap cost about one such batch each (three to five, with the
quarter batches scouted under a limit that kills), and each longer length alone is
estimated at up to 16 times the step before: 20 lets a long-context model prove one or two
lengths past the token cap without waiting minutes for its maximum."""
MIN_BOUND_S = 10.0
"""The default bound is never shorter: a small model's whole ladder takes less than this,
and a bound of milliseconds would only cut it short at random."""


@dataclass(frozen=True, slots=True)
class CalibrationStep:
    num_items: int
    length: int
    kind: str = "batch"
    """``batch``; ``scout``: a quarter of the batch first, at the first length (two batch
    sizes tell the fixed cost of a pass from its per-token cost) and where memory sets the
    batch and going past the limit gives no error; ``alone``: one input at the longest
    proven length, so that the line of a lone input is measured before it is extrapolated
    to the next length."""


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    proven_length: int | None
    max_length: int
    elapsed_s: float
    bound_s: float | None
    stopped: str | None = None
    """Why warm-up stopped short of the maximum length; None if it reached it."""

    def describe(self) -> str:
        """``longest proven input 8192 tokens of 32768``."""
        proven = "none" if self.proven_length is None else f"{self.proven_length} tokens"
        return f"longest proven input {proven} of {self.max_length}"


def calibration_lengths(
    max_length: int, *, first: int = FIRST_LENGTH, factor: int = LENGTH_FACTOR
) -> list[int]:
    """``first``, then x ``factor``, ending at ``max_length``: 32, 128, 512, 2048, 8192,
    32768 for a 32k model; 32, 128, 256 for a 256-token one."""
    lengths = [min(first, max_length)]
    while lengths[-1] < max_length:
        lengths.append(min(max_length, lengths[-1] * factor))
    return lengths


def seconds_at_most(ran: tuple[int, int, float], step: CalibrationStep) -> float:
    """An upper bound on ``step``'s time from a batch that ran (``n, L, seconds``), for a
    pass costing ``a + b n L + c n L^2`` with non-negative terms: each term grows by at
    most the larger of the two ratios."""
    n, length, seconds = ran
    tokens = step.num_items * step.length / (n * length)
    return seconds * max(1.0, tokens, tokens * step.length / length)


class WarmUpPlanner:
    """Chooses each calibration step from the budget read before it, the time spent so far
    and what the steps before it did; the loop runs each step and reports back."""

    def __init__(
        self, *, max_length: int, max_items: int, timeout_s: float | None = None,
        batches_in_bound: int = WARMUP_BATCHES,
    ) -> None:  # fmt: skip
        self.max_length = max_length
        self.max_items = max_items
        self.lengths = calibration_lengths(max_length)
        self.bound_s = timeout_s
        self._batches_in_bound = batches_in_bound
        self._index = 0
        self._cap = max_items
        self._scouted = False
        self._alone_ran = False
        """One input alone has run, or was tried and ran out of memory."""
        self._last: tuple[int, int, float] | None = None
        self.proven_length: int | None = None
        self.stopped: str | None = None

    def next_step(
        self, budget: BatchBudget, *, elapsed_s: float, scout: bool = False
    ) -> CalibrationStep | None:
        """The next batch to run, or None when warm-up is done (``stopped`` says why, if it
        ended short of the maximum length). ``scout``: going past the binding limit gives
        no error, so where memory sets a batch, a quarter of it runs first."""
        if self._index >= len(self.lengths):
            if self._alone_ran or self.proven_length is None:
                return None
            # The ladder ended without one input alone: one at the longest length, so that
            # a lone input's line (no padding, no mask) is measured, not scaled.
            step = CalibrationStep(1, self.proven_length, "alone")
            if self.stopped is not None:  # a stop already said why: no second reason
                return step if self._fits_bound(step, elapsed_s) else None
            return self._within_bound(step, elapsed_s)
        length = self.lengths[self._index]
        fits = largest_batch(budget, length)
        num_items = min(self._cap, fits)
        if num_items == 0 and _fits_alone(budget, length):
            num_items = 1  # past the token cap an input runs alone, as serving runs it
        if num_items == 0:
            if self.proven_length is None:
                num_items = 1  # nothing could be served otherwise: the first length runs
            else:
                predicted = budget.predict_bytes(1, length) if budget.predict_bytes else 0.0
                room = budget.max_bytes or 0.0
                stop = self._stop(
                    f"one input of {length} tokens is predicted to need "
                    f"{predicted / 2**20:.0f} MiB, more than the {room / 2**20:.0f} MiB budget"
                )
                return stop if stop is not None and self._fits_bound(stop, elapsed_s) else None
        if num_items == 1 and not self._alone_ran and self.proven_length is not None:
            step = CalibrationStep(1, self.proven_length, "alone")
        elif (
            num_items >= 4
            and not self._scouted
            and (self._index == 0 or (scout and fits < self._cap_at(budget, length)))
        ):
            step = CalibrationStep(num_items // 4, length, "scout")
        else:
            step = CalibrationStep(num_items, length)
        return self._within_bound(step, elapsed_s)

    def _cap_at(self, budget: BatchBudget, length: int) -> int:
        """The batch the caps alone allow at ``length``: memory sets a batch smaller than
        this (only then is a scout worth its time)."""
        return min(self._cap, budget.max_items, max(1, budget.max_tokens // length))

    def _within_bound(self, step: CalibrationStep, elapsed_s: float) -> CalibrationStep | None:
        if self._fits_bound(step, elapsed_s):
            return step
        assert self._last is not None and self.bound_s is not None
        stop = self._stop(
            f"a batch of {step.num_items} x {step.length} tokens may take up to "
            f"{seconds_at_most(self._last, step):.1f}s, past the {self.bound_s:.0f}s warm-up "
            f"bound ({elapsed_s:.1f}s spent)"
        )
        return stop if stop is not None and self._fits_bound(stop, elapsed_s) else None

    def _fits_bound(self, step: CalibrationStep, elapsed_s: float) -> bool:
        if self.bound_s is None or self._last is None:
            return True
        return elapsed_s + seconds_at_most(self._last, step) <= self.bound_s

    def ran(self, step: CalibrationStep, seconds: float) -> None:
        """``step`` ran cleanly in ``seconds``."""
        self._last = (step.num_items, step.length, seconds)
        self.proven_length = max(self.proven_length or 0, step.length)
        if step.num_items == 1:
            self._alone_ran = True
        if self.bound_s is None and step.kind == "batch":
            self.bound_s = max(MIN_BOUND_S, self._batches_in_bound * seconds)
        if step.kind == "scout":
            self._scouted = True
        elif step.kind == "batch":
            self._index += 1
            self._cap = self.max_items
            self._scouted = False

    def ran_out_of_memory(self, step: CalibrationStep) -> None:
        """``step`` ran out of memory (an allocation failed): halve the batch, or stop at
        one input."""
        if step.num_items == 1:
            self._alone_ran = True  # tried: not again at the longest proven length
            self._stop(f"one input of {step.length} tokens ran out of memory")
            return
        self._cap = max(1, step.num_items // 2)

    def report(self, elapsed_s: float) -> WarmUpReport:
        return WarmUpReport(
            proven_length=self.proven_length, max_length=self.max_length, elapsed_s=elapsed_s,
            bound_s=self.bound_s, stopped=self.stopped,
        )  # fmt: skip

    def _stop(self, reason: str) -> CalibrationStep | None:
        """End the ladder; but first, if no input has run alone, one alone at the longest
        proven length: a lone input's line is measured, not scaled from the batches'."""
        self.stopped = reason
        self._index = len(self.lengths)
        if self._alone_ran or self.proven_length is None:
            return None
        return CalibrationStep(1, self.proven_length, "alone")


class WarmUp:
    """Warm-up's decisions for one model and its sizer. Adaptive: the planner's ladder of
    lengths within the budget and the time bound, the sizer calibrating its memory model
    on each batch that ran and lowering its ceiling after each OOM, so nothing starts with
    a budget it cannot run. Fixed: one batch of its own budget's shape, as other servers
    warm up, halved after each OOM."""

    def __init__(
        self, sizer: Sizer, *, max_input_tokens: int, max_items: int,
        timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        self.sizer = sizer
        self.max_input_tokens = max_input_tokens
        self.adaptive = isinstance(sizer, AdaptiveSizer)
        self.planner = WarmUpPlanner(
            max_length=max_input_tokens, max_items=max_items, timeout_s=timeout_s
        )
        self.current: CalibrationStep | None = None
        """The batch from ``next_batch``, until it ran or ran out of memory."""
        self._fixed: CalibrationStep | None = None
        if not self.adaptive:
            budget = sizer.budget()
            length = min(max_input_tokens, max(2, budget.max_tokens // budget.max_items))
            self._fixed = CalibrationStep(budget.max_items, length)

    def next_batch(
        self, reading: MemoryReading | None, *, elapsed_s: float = 0.0
    ) -> CalibrationStep | None:
        """The next warm-up batch, or None when warm-up is done."""
        if self.adaptive:
            # NOTE: past a cgroup's limit (or the host's memory) the kernel kills the
            # process: no error comes back to lower the ceiling on. Where memory, not a
            # cap, sets a batch's size, a quarter of it runs first, so the full one is
            # planned by a model corrected at this length, not by the prior alone.
            self.current = self.planner.next_step(
                self.sizer.budget(reading), elapsed_s=elapsed_s, scout=scouts(reading)
            )
        else:
            self.current = self._fixed
        return self.current

    def ran(self, outcome: BatchOutcome) -> None:
        """The batch from ``next_batch`` ran cleanly."""
        step = self.current
        assert step is not None
        self.current = None
        if self.adaptive:
            self.sizer.calibrate(outcome)  # type: ignore[attr-defined]
            self.planner.ran(step, outcome.elapsed_s)
        else:
            self.planner.proven_length = step.length
            self._fixed = None
        log.info(
            "warm-up batch of %d x %d tokens%s: %.3fs, peak %s", step.num_items, step.length,
            "" if step.kind == "batch" else f" ({step.kind})", outcome.elapsed_s,
            f"{outcome.peak_bytes / 2**20:.1f} MiB" if outcome.peak_bytes else "n/a",
        )  # fmt: skip

    def out_of_memory(self) -> None:
        """The batch from ``next_batch`` ran out of memory."""
        step = self.current
        assert step is not None
        self.current = None
        self.sizer.on_oom(step.num_items, step.length)
        if step.num_items == 1:
            log.warning("one input of %d tokens does not fit in memory", step.length)
        else:
            log.info("warm-up batch of %d x %d ran out of memory", step.num_items, step.length)
        if self.adaptive:
            self.planner.ran_out_of_memory(step)
        elif step.num_items == 1:
            self._fixed = None
        else:  # a fixed sizer has no ceiling to lower: a smaller batch of the same shape
            self._fixed = CalibrationStep(step.num_items // 2, step.length)

    def finish(self, elapsed_s: float = 0.0) -> WarmUpReport:
        """What warm-up proved. From now on the adaptive sizer's ceiling stays within it."""
        if self.adaptive:
            sizer: AdaptiveSizer = self.sizer  # type: ignore[assignment]
            sizer.finish_warm_up()
            model, ceiling = sizer.model, sizer.ceiling_bytes
            log.info(
                "memory model: %.0f bytes/token + %.1f bytes/token x length (alone: %.0f + "
                "%.1f); ceiling %s", model.alpha, model.beta, *model.line(1),
                "none" if ceiling == float("inf") else f"{ceiling / 2**20:.0f} MiB",
            )  # fmt: skip
            return self.planner.report(elapsed_s)
        return WarmUpReport(self.planner.proven_length, self.max_input_tokens, elapsed_s, None)


def _fits_alone(budget: BatchBudget, length: int) -> bool:
    """One input of ``length`` within the memory budget, whatever the token cap says."""
    if budget.max_bytes is None or budget.predict_bytes is None:
        return True
    return budget.predict_bytes(1, length) <= budget.max_bytes


def scouts(reading: MemoryReading | None) -> bool:
    """Whether warm-up runs a quarter batch first where memory sets a batch's size: going
    past the binding limit's value gives no allocation error to lower the ceiling on. The
    kernel kills (``cgroup``, ``host``), or nothing enforces the limit at its value
    (``flag``: resident memory can pass ``--memory-limit`` silently, the address-space cap
    standing above it). The address space and a device fail an allocation instead. (Not the
    same question as ``limit_kills``: which limit kills decides refusals, which limit binds
    decides scouting.)"""
    return reading is not None and reading.limit is not None and reading.limit.source in (
        "cgroup", "host", "flag",
    )  # fmt: skip
