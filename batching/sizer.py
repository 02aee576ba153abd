"""Sizers decide the budget of the next batch; the batcher reports back what each batch did.

The adaptive sizer predicts a batch's peak memory with a ``PeakModel`` (``peak_model.py``),
fitted to the peaks measured and to the OOMs that still weigh, and caps the budget by a
ceiling that an OOM lowers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from .peak_model import (
    MASKLESS_ATTENTION,
    PeakModel,
    PriorShape,
    fit_envelope,
    prior_for,
    prior_peak_model,
)
from .planner import BatchBudget
from .probes import MemoryReading, refusal_room

__all__ = [  # the peak model's names too, as imported from here before it had a module
    "MASKLESS_ATTENTION",
    "AdaptiveConfig",
    "AdaptiveSizer",
    "BatchOutcome",
    "FixedSizer",
    "PeakModel",
    "PriorShape",
    "Sizer",
    "fit_envelope",
    "prior_for",
    "prior_peak_model",
]


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What one forward pass did, as the batcher measured it."""

    num_items: int
    padded_len: int
    elapsed_s: float
    peak_bytes: int | None = None  # above the memory in use before the batch


class Sizer(Protocol):
    def budget(self, reading: MemoryReading | None = None) -> BatchBudget:
        """The budget for the next batch, given what the probes read now."""
        ...

    def observe(self, outcome: BatchOutcome) -> None:
        """A batch ran cleanly."""
        ...

    def on_oom(self, num_items: int, padded_len: int) -> None:
        """A batch of this shape ran out of memory."""
        ...


class FixedSizer:
    """A constant budget: at most ``max_items`` items and ``max_tokens`` padded tokens."""

    def __init__(self, max_items: int, max_tokens: int) -> None:
        self._budget = BatchBudget(max_items=max_items, max_tokens=max_tokens)

    def budget(self, reading: MemoryReading | None = None) -> BatchBudget:
        return self._budget

    def observe(self, outcome: BatchOutcome) -> None:
        pass

    def on_oom(self, num_items: int, padded_len: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    max_items: int
    max_tokens: int
    headroom_fraction: float = 0.15
    safety_factor: float = 1.1
    """Predictions are multiplied by this before they are compared with the budget."""
    oom_decrease: float = 0.7
    recovery_fraction: float = 0.05
    """After a clean batch the ceiling rises by this share of what warm-up proved; an OOM's
    evidence lapses after as many clean batches as take the ceiling from nothing back up."""
    target_latency_s: float | None = None
    num_samples: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.headroom_fraction < 1:
            raise ValueError(f"headroom_fraction must be in [0, 1), got {self.headroom_fraction}")
        if not 0 < self.oom_decrease < 1:
            raise ValueError(f"oom_decrease must be in (0, 1), got {self.oom_decrease}")
        if self.target_latency_s is not None and self.target_latency_s <= 0:
            raise ValueError(f"target_latency_s must be positive, got {self.target_latency_s}")


@dataclass(frozen=True, slots=True)
class _OutOfMemory:
    """A pass that ran out of memory: it needed more than the ``free_bytes`` read before it."""

    num_items: int
    padded_len: int
    free_bytes: int
    clean_batch: int
    """The sizer's count of clean batches when it happened."""

    @property
    def sample(self) -> tuple[int, int, float]:
        return self.num_items, self.padded_len, float(self.free_bytes)

    def covered_by(self, num_items: int, padded_len: int) -> bool:
        """A pass of this shape holds at least as much as the one that failed."""
        return num_items >= self.num_items and padded_len >= self.padded_len


@dataclass(frozen=True, slots=True)
class _Predictor:
    """``AdaptiveSizer.predict`` by another model than the sizer's own."""

    model: PeakModel
    config: AdaptiveConfig

    def __call__(self, num_items: int, padded_len: int) -> float:
        return self.model.predict(num_items, padded_len) * self.config.safety_factor


class AdaptiveSizer:
    """Budget = free memory now x (1 - headroom), capped by a ceiling that drops after an
    OOM (x ``oom_decrease``) and climbs back additively after clean batches, never above
    what warm-up proved. An optional latency target caps padded tokens the same way (AIMD).

    An OOM also lifts the model through the memory that was free when it happened. That
    evidence weighs only while no more memory is free, and lapses once a clean pass at
    least as large runs or after the clean batches that restore the ceiling."""

    def __init__(self, prior: PeakModel, config: AdaptiveConfig) -> None:
        self.config = config
        self.prior = prior
        self.model = prior
        """Fitted to every peak measured and every OOM still weighing: what ``predict`` uses."""
        self._measured = prior  # fitted to the peaks measured alone
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=config.num_samples)
        self._pinned: list[tuple[int, int, float]] = []  # warm-up samples, never evicted
        self._ooms: deque[_OutOfMemory] = deque(maxlen=config.num_samples)
        self._clean_batches = 0
        self._oom_lapse = (
            math.ceil(1 / config.recovery_fraction) if config.recovery_fraction > 0 else None
        )
        self._partial: tuple[tuple[_OutOfMemory, ...], PeakModel] | None = None
        self._proven_shapes: list[tuple[int, int]] = []
        self.proven_bytes: float | None = None
        self.ceiling_bytes: float = math.inf
        self.latency_tokens: float = float(config.max_tokens)
        self.last_free_bytes: int | None = None

    def predict(self, num_items: int, padded_len: int) -> float:
        return self.model.predict(num_items, padded_len) * self.config.safety_factor

    def memory_budget(self, free_bytes: int | None) -> float | None:
        """Bytes the next batch's predicted peak may use (None: no reading, no memory cap)."""
        if free_bytes is None:
            return None if math.isinf(self.ceiling_bytes) else self.ceiling_bytes
        return min(free_bytes * (1 - self.config.headroom_fraction), self.ceiling_bytes)

    def budget(self, reading: MemoryReading | None = None) -> BatchBudget:
        free = reading.free_bytes if reading is not None else None
        self.last_free_bytes = free
        max_tokens = max(1, min(self.config.max_tokens, int(self.latency_tokens)))
        model = self._model_at(free)
        predict = self.predict if model is self.model else _Predictor(model, self.config)
        # NOTE: a lone input is held to the room under a limit that kills, less headroom,
        # not to the ceiling: the ceiling is what warm-up proved, and beyond it the fitted
        # model predicts.
        room = refusal_room(reading)
        return BatchBudget(
            max_items=self.config.max_items,
            max_tokens=max_tokens,
            max_bytes=self.memory_budget(free),
            predict_bytes=predict,
            max_alone_bytes=None if room is None else room * (1 - self.config.headroom_fraction),
            shared_bytes=None if free is None else free * (1 - self.config.headroom_fraction),
        )

    def _model_at(self, free_bytes: int | None) -> PeakModel:
        """The model with the OOMs that weigh at this much free memory: those that happened
        with at least as much free (the pass needed more than is free now). One that happened
        with less says nothing of whether it fits now; the ceiling keeps the planner careful."""
        weighing = tuple(
            oom for oom in self._ooms if free_bytes is None or oom.free_bytes >= free_bytes
        )
        if len(weighing) == len(self._ooms):
            return self.model
        if not weighing:
            return self._measured
        if self._partial is None or self._partial[0] != weighing:
            samples = [*self._pinned, *self._samples, *(oom.sample for oom in weighing)]
            self._partial = (weighing, fit_envelope(self.prior, samples))
        return self._partial[1]

    def _refit(self) -> None:
        self._measured = fit_envelope(self.prior, [*self._pinned, *self._samples])
        self.model = self._measured
        if self._ooms:
            samples = [*self._pinned, *self._samples, *(oom.sample for oom in self._ooms)]
            self.model = fit_envelope(self.prior, samples)
        self._partial = None

    def _ran_clean(self, num_items: int, padded_len: int) -> bool:
        """Forget the OOMs a clean pass of this shape outlived: it held at least as much as
        the pass that failed (the failure was transient), or it is the clean batch after which
        they lapse. True where any was forgotten."""
        lapse = self._oom_lapse
        kept = [
            oom for oom in self._ooms
            if not oom.covered_by(num_items, padded_len)
            and (lapse is None or self._clean_batches - oom.clean_batch < lapse)
        ]  # fmt: skip
        if len(kept) == len(self._ooms):
            return False
        self._ooms = deque(kept, maxlen=self._ooms.maxlen)
        return True

    def observe(self, outcome: BatchOutcome) -> None:
        self._clean_batches += 1
        refit = self._ran_clean(outcome.num_items, outcome.padded_len)
        # NOTE: only peaks above the measured line correct it (not above a line an OOM lifted:
        # what is measured meanwhile must outlive the OOM). While serving, the allocator
        # reuses memory it already holds, so a low reading is not evidence of a small peak.
        peak = outcome.peak_bytes
        line = self._measured.predict(outcome.num_items, outcome.padded_len)
        if peak is not None and peak > line:
            self._samples.append((outcome.num_items, outcome.padded_len, peak))
            refit = True
        if refit:
            self._refit()
        if self.proven_bytes is not None and self.ceiling_bytes < self.proven_bytes:
            step = self.proven_bytes * self.config.recovery_fraction
            self.ceiling_bytes = min(self.proven_bytes, self.ceiling_bytes + step)
        target = self.config.target_latency_s
        if target is not None:
            if outcome.elapsed_s > target:
                self.latency_tokens = max(1.0, self.latency_tokens * self.config.oom_decrease)
            else:
                step = self.config.max_tokens * self.config.recovery_fraction
                self.latency_tokens = min(float(self.config.max_tokens), self.latency_tokens + step)

    def on_oom(self, num_items: int, padded_len: int) -> None:
        # What the budget read before the batch predicted for it.
        model = self._model_at(self.last_free_bytes)
        failed = model.predict(num_items, padded_len) * self.config.safety_factor
        self.ceiling_bytes = min(self.ceiling_bytes, failed) * self.config.oom_decrease
        # The batch needed more than was free when it started: the model must say so, while
        # no more is free and until later evidence outweighs it (``_model_at``, ``_ran_clean``).
        free = self.last_free_bytes
        if free is not None and failed < free:
            self._ooms.append(_OutOfMemory(num_items, padded_len, free, self._clean_batches))
            self._refit()

    def calibrate(self, outcome: BatchOutcome) -> None:
        """A warm-up batch ran: keep its sample for good and count its shape as proven."""
        refit = self._ran_clean(outcome.num_items, outcome.padded_len)
        if outcome.peak_bytes is not None and outcome.peak_bytes > 0:
            self._pinned.append((outcome.num_items, outcome.padded_len, outcome.peak_bytes))
            refit = True
        if refit:
            self._refit()
        self._proven_shapes.append((outcome.num_items, outcome.padded_len))

    @property
    def proven_length(self) -> int | None:
        """The longest padded length a warm-up batch ran at (None before one has)."""
        return max((length for _, length in self._proven_shapes), default=None)

    def finish_warm_up(self) -> None:
        """From now on the ceiling never rises above what warm-up proved: the predicted peak
        (by the model as calibrated) of the largest warm-up batch that ran."""
        if self._proven_shapes:
            self.proven_bytes = max(self.predict(n, length) for n, length in self._proven_shapes)
            self.ceiling_bytes = min(self.ceiling_bytes, self.proven_bytes)
