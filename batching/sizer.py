"""Sizers decide the budget of the next batch; the batcher reports back what each batch did.

The adaptive sizer models a forward pass's peak memory above what is in use before it as

    peak_bytes(n, L) = alpha * n * L + beta * n * L**2

(n items padded to L tokens: hidden states, Q/K/V and the feed-forward grow with n*L,
attention scores with n*L**2). It starts from a prior derived from the model's shape and
corrects alpha and beta from measured peaks, as an upper envelope rather than a mean.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from .planner import BatchBudget
from .probes import MemoryReading


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
class PeakModel:
    alpha: float  # bytes per token (n * L)
    beta: float  # bytes per n * L**2

    def predict(self, num_items: int, padded_len: int) -> float:
        return num_items * padded_len * (self.alpha + self.beta * padded_len)


def prior_peak_model(
    *, hidden_size: int, intermediate_size: int, num_heads: int, element_bytes: int
) -> PeakModel:
    """A deliberately generous first guess from the config (DESIGN.md: the sizer)."""
    return PeakModel(
        alpha=element_bytes * (8 * hidden_size + 2 * intermediate_size),
        beta=element_bytes * 2 * num_heads,
    )


def fit_envelope(prior: PeakModel, samples: list[tuple[int, int, float]]) -> PeakModel:
    """Fit ``peak / (n L) = alpha + beta L`` to ``(n, L, peak)`` samples, then raise alpha
    until no sample lies above the line. With too narrow a spread of lengths to separate
    the two terms, scale the prior to cover every sample instead."""
    if not samples:
        return prior
    points = [(length, peak / (n * length)) for n, length, peak in samples if n and length]
    lengths = [length for length, _ in points]
    if len(set(lengths)) >= 2 and max(lengths) >= 1.5 * min(lengths):
        mean_l = sum(lengths) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        var = sum((length - mean_l) ** 2 for length in lengths)
        cov = sum((length - mean_l) * (y - mean_y) for length, y in points)
        beta = max(0.0, cov / var)
        alpha = max(0.0, mean_y - beta * mean_l)
        alpha += max(0.0, max(y - (alpha + beta * length) for length, y in points))
        return PeakModel(alpha=alpha, beta=beta)
    scale = max(y / (prior.alpha + prior.beta * length) for length, y in points)
    return PeakModel(alpha=prior.alpha * scale, beta=prior.beta * scale)


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    max_items: int
    max_tokens: int
    headroom_fraction: float = 0.15
    safety_factor: float = 1.1
    """Predictions are multiplied by this before they are compared with the budget."""
    oom_decrease: float = 0.7
    recovery_fraction: float = 0.05
    """After a clean batch the ceiling rises by this share of what warm-up proved."""
    target_latency_s: float | None = None
    num_samples: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.headroom_fraction < 1:
            raise ValueError(f"headroom_fraction must be in [0, 1), got {self.headroom_fraction}")
        if not 0 < self.oom_decrease < 1:
            raise ValueError(f"oom_decrease must be in (0, 1), got {self.oom_decrease}")
        if self.target_latency_s is not None and self.target_latency_s <= 0:
            raise ValueError(f"target_latency_s must be positive, got {self.target_latency_s}")


class AdaptiveSizer:
    """Budget = free memory now x (1 - headroom), capped by a ceiling that drops after an
    OOM (x ``oom_decrease``) and climbs back additively after clean batches, never above
    what warm-up proved. An optional latency target caps padded tokens the same way (AIMD)."""

    def __init__(self, prior: PeakModel, config: AdaptiveConfig) -> None:
        self.config = config
        self.prior = prior
        self.model = prior
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=config.num_samples)
        self._pinned: list[tuple[int, int, float]] = []  # warm-up samples, never evicted
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
        return BatchBudget(
            max_items=self.config.max_items,
            max_tokens=max_tokens,
            max_bytes=self.memory_budget(free),
            predict_bytes=self.predict,
        )

    def observe(self, outcome: BatchOutcome) -> None:
        # NOTE: only peaks above the model's line correct it. While serving, the allocator
        # reuses memory it already holds, so a low reading is not evidence of a small peak.
        peak = outcome.peak_bytes
        if peak is not None and peak > self.model.predict(outcome.num_items, outcome.padded_len):
            self._samples.append((outcome.num_items, outcome.padded_len, peak))
            self.model = fit_envelope(self.prior, [*self._pinned, *self._samples])
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
        failed = self.predict(num_items, padded_len)
        self.ceiling_bytes = min(self.ceiling_bytes, failed) * self.config.oom_decrease
        # The batch needed more than was free when it started: the model must say so.
        if self.last_free_bytes is not None and failed < self.last_free_bytes:
            self._samples.append((num_items, padded_len, float(self.last_free_bytes)))
            self.model = fit_envelope(self.prior, [*self._pinned, *self._samples])

    def calibrate(self, outcome: BatchOutcome) -> None:
        """A warm-up batch ran: keep its sample for good and count its shape as proven."""
        if outcome.peak_bytes is not None and outcome.peak_bytes > 0:
            self._pinned.append((outcome.num_items, outcome.padded_len, outcome.peak_bytes))
            self.model = fit_envelope(self.prior, [*self._pinned, *self._samples])
        self._proven_shapes.append((outcome.num_items, outcome.padded_len))

    def finish_warm_up(self) -> None:
        """From now on the ceiling never rises above what warm-up proved: the predicted peak
        (by the model as calibrated) of the largest warm-up batch that ran."""
        if self._proven_shapes:
            self.proven_bytes = max(self.predict(n, length) for n, length in self._proven_shapes)
            self.ceiling_bytes = min(self.ceiling_bytes, self.proven_bytes)
