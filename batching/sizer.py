"""Sizers decide the budget of the next batch; the batcher reports back what each batch did.

The adaptive sizer models a forward pass's peak memory above what is in use before it as

    peak_bytes(n, L) = alpha * n * L + beta * n * L**2

(n items padded to L tokens: hidden states, Q/K/V and the feed-forward grow with n*L,
attention scores with n*L**2; what a batch's items share, a sliding window's token distances,
is the larger of it and ``shared_beta * L**2``). It starts from a prior derived from the
model's shape and corrects alpha and beta from measured peaks, as an upper envelope rather
than a mean.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from .planner import BatchBudget
from .probes import MemoryReading, refusal_room
from .timing import fit_time_model


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
    """``peak(n, L) = n * L * (alpha + beta * L)`` for a batch of several inputs; one input
    alone has its own line (``alone_alpha``, ``alone_beta``) where known, since a lone input
    has no padding and so no attention mask where the kernel needs none (sdpa)."""

    alpha: float  # bytes per token (n * L)
    beta: float  # bytes per n * L**2
    alone_alpha: float | None = None
    alone_beta: float | None = None
    """A lone input's line; None: the batch line."""
    fixed_bytes: float = 0.0
    """What any pass adds whatever its size (on a CPU, the allocator's slack: about 1 MiB
    while warm-up measures), learnt where warm-up ran two batch sizes."""
    measured_length: int | None = None
    """The longest length the batch line was measured at (``measured_alone_length``: the
    lone line); beyond it the line's ``L**2`` term grows at least as fast as the prior's
    (``prior_beta``, ``prior_alone_beta``). At short lengths the quadratic term hides under
    the per-token one: a fitted slope near zero under-predicted a padded batch's attention
    mask at 3 x 8192 tokens by half, from a warm-up that had measured up to 512."""
    measured_alone_length: int | None = None
    prior_beta: float = 0.0
    prior_alone_beta: float = 0.0
    shared_beta: float = 0.0
    """Bytes per ``L**2`` once per batch of several, whatever its size: what its items share
    (a sliding-window layer's token distances, built once while the masks are made and freed
    before the layers run). A batch's quadratic term is the larger of ``n * beta`` and this.
    A lone input's line holds it already; a fitted model folds it into its batch line."""
    prior_shared_beta: float = 0.0

    def predict(self, num_items: int, padded_len: int) -> float:
        alpha, beta = self.line(num_items)
        n, length = num_items, padded_len
        alone = n == 1 and self.alone_alpha is not None and self.alone_beta is not None
        shared = 0.0 if alone else self.shared_beta
        # What the items share is built before the layers run and freed before they end:
        # the quadratic term is the larger of the two, not their sum.
        quadratic = max(n * beta, shared)
        peak = self.fixed_bytes + n * length * alpha + quadratic * length**2
        measured = self.measured_alone_length if alone else self.measured_length
        if measured is not None and length > measured:
            if alone:
                floor = self.prior_alone_beta
            else:
                floor = max(n * self.prior_beta, self._shared_floor(length))
            peak += (length**2 - measured**2) * max(0.0, floor - quadratic)
        return peak

    def _shared_floor(self, padded_len: int) -> float:
        """What a batch's items share per ``L**2`` at most: the prior's, or less where a lone
        input was measured at this length (its quadratic term holds the shared part)."""
        lone = self.alone_beta
        if lone is not None and (self.measured_alone_length or 0) >= padded_len:
            return min(self.prior_shared_beta, lone)
        return self.prior_shared_beta

    def line(self, num_items: int) -> tuple[float, float]:
        """``(alpha, beta)`` for a batch of ``num_items``."""
        if num_items == 1 and self.alone_alpha is not None and self.alone_beta is not None:
            return self.alone_alpha, self.alone_beta
        return self.alpha, self.beta


# Attention implementations that hold no L x L tensor at all (varlen kernels skip padding).
MASKLESS_ATTENTION = ("flash_attention_2", "flash_attention_3", "paged_attention")


def prior_peak_model(
    *, hidden_size: int, intermediate_size: int, num_heads: int, element_bytes: int,
    num_kv_heads: int | None = None, head_dim: int | None = None, attention: str = "eager",
    sliding_window: int | None = None, gated_mlp: bool = False,
) -> PeakModel:  # fmt: skip
    """A deliberately generous first guess from the architecture (docs/memory.md, "The
    prior").

    Per token (``alpha``): the hidden states a layer holds at once (residual, normalised,
    attention output: ``8 * hidden`` leaves room for the embeddings, the output and the
    pooling's copies), the query/key/value projections (``heads + 2 * kv_heads`` heads of
    ``head_dim``; key/value heads repeated to every head where the kernel needs it), and the
    feed-forward's two activations, three when gated. Per ``n * L**2`` (``beta``): ``eager``
    holds each head's scores and probabilities and the float mask; ``sdpa`` holds none but
    the padded batch's mask (one byte, and its float copy on a CPU), which a lone input
    without a sliding window does not need. A sliding-window layer builds its window from
    integer token distances even for one input, once per batch and before the layers run
    (``shared_beta``: a ModernBERT at 4,096 tokens peaked at 16.1 bytes per ``L**2`` alone,
    18.2 for two inputs, 26.7 for four and 52.9 for eight, each input then holding its own
    window mask beside the full one). Flash kernels hold no ``L x L`` tensor.
    """
    e = element_bytes
    head_dim = head_dim or hidden_size // max(1, num_heads)
    kv_heads = num_kv_heads or num_heads
    attention_width = (num_heads + 2 * kv_heads) * head_dim
    alpha = e * (8 * hidden_size + attention_width + (3 if gated_mlp else 2) * intermediate_size)
    if attention in MASKLESS_ATTENTION:
        return PeakModel(alpha=alpha, beta=0.0, alone_alpha=alpha, alone_beta=0.0)
    mask = 1 + e  # a boolean mask and the float copy the CPU kernel makes of it
    window = 1 if sliding_window else 0  # each input's own window mask beside the full one
    distances = 2 * 8 + mask if sliding_window else 0.0  # int64 distances, then the mask
    if attention == "eager":
        beta = e * 3 * num_heads + e + window
        return PeakModel(
            alpha=alpha, beta=beta, alone_alpha=alpha, alone_beta=max(beta, distances),
            shared_beta=distances, prior_shared_beta=distances,
        )  # fmt: skip
    return PeakModel(
        alpha=alpha, beta=mask + window, alone_alpha=alpha, alone_beta=distances,
        shared_beta=distances, prior_shared_beta=distances,
    )  # fmt: skip


class PriorShape(Protocol):
    """What the prior reads of a model's architecture (``models.ModelShape`` has it)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    element_bytes: int
    num_kv_heads: int | None
    head_dim: int | None
    attention: str
    sliding_window: int | None
    gated_mlp: bool


def prior_for(shape: PriorShape) -> PeakModel:
    """``prior_peak_model`` of a model's shape: the server's and a bulk job's alike."""
    return prior_peak_model(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_heads=shape.num_heads,
        element_bytes=shape.element_bytes,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        attention=shape.attention,
        sliding_window=shape.sliding_window,
        gated_mlp=shape.gated_mlp,
    )


def _fit_line(
    prior: tuple[float, float], samples: list[tuple[int, int, float]]
) -> tuple[float, float]:
    """Fit ``peak / (n L) = alpha + beta L`` to ``(n, L, peak)`` samples, then raise alpha
    until no sample lies above the line. With too narrow a spread of lengths to separate
    the two terms, scale the prior to cover every sample instead.

    ``beta`` is the larger of the least-squares slope and the slope between the two longest
    lengths: a forward pass's fixed costs weigh most at the shortest lengths and flatten the
    least-squares slope, and it is ``beta`` that predicts lengths beyond those measured."""
    points = [(length, peak / (n * length)) for n, length, peak in samples if n and length]
    if not points:
        return prior
    lengths = [length for length, _ in points]
    if len(set(lengths)) >= 2 and max(lengths) >= 1.5 * min(lengths):
        mean_l = sum(lengths) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        var = sum((length - mean_l) ** 2 for length in lengths)
        cov = sum((length - mean_l) * (y - mean_y) for length, y in points)
        longest, second = sorted(set(lengths))[-1], sorted(set(lengths))[-2]
        top = {at: max(y for length, y in points if length == at) for at in (longest, second)}
        tail = (top[longest] - top[second]) / (longest - second)
        beta = max(0.0, cov / var, tail)
        alpha = max(0.0, mean_y - beta * mean_l)
        alpha += max(0.0, max(y - (alpha + beta * length) for length, y in points))
        return alpha, beta
    scale = max(y / (prior[0] + prior[1] * length) for length, y in points)
    return prior[0] * scale, prior[1] * scale


def fixed_cost(samples: list[tuple[int, int, float]]) -> float:
    """The part of a pass's peak that does not grow with its tokens: the constant of a
    non-negative fit of ``fixed + a n L + b n L^2`` to the samples (relative error, as the
    time model is fitted), where they hold token counts at least 2x apart; else 0. At most
    90% of the smallest sample: the rest of every sample is left to the per-token terms."""
    tokens = [n * length for n, length, _ in samples]
    if len(samples) < 3 or max(tokens) < 2 * min(tokens):
        return 0.0
    fitted = fit_time_model(samples)
    if fitted is None:
        return 0.0
    return min(fitted[0], 0.9 * min(peak for _, _, peak in samples))


def fit_envelope(prior: PeakModel, samples: list[tuple[int, int, float]]) -> PeakModel:
    """The batch line fitted to the samples of several inputs, the lone line to those of
    one (``_fit_line``: an upper envelope of each), above the fixed cost of a pass
    (``fixed_cost`` of the batch samples). A line without samples of its own is the
    prior's, scaled as the other line was: what was learnt of the model applies to both."""
    fixed = fixed_cost(samples)
    samples = [(n, length, max(0.0, peak - fixed)) for n, length, peak in samples]
    batch = [s for s in samples if s[0] > 1]
    alone = [s for s in samples if s[0] == 1]
    prior_batch = prior.line(2)
    prior_alone = prior.line(1)
    if not batch and not alone:
        return prior
    alpha = beta = alone_alpha = alone_beta = 0.0
    if batch:
        alpha, beta = _fit_line(prior_batch, batch)
    if alone:
        alone_alpha, alone_beta = _fit_line(prior_alone, alone)
    if not batch:
        alpha, beta = _scaled(prior_batch, prior_alone, (alone_alpha, alone_beta))
    if not alone:
        alone_alpha, alone_beta = _scaled(prior_alone, prior_batch, (alpha, beta))
    return PeakModel(
        alpha=alpha, beta=beta, alone_alpha=alone_alpha, alone_beta=alone_beta,
        fixed_bytes=fixed, measured_length=_longest(batch) or _longest(alone),
        measured_alone_length=_longest(alone) or _longest(batch), prior_beta=prior_batch[1],
        prior_alone_beta=prior_alone[1], prior_shared_beta=prior.prior_shared_beta,
    )  # fmt: skip


def _longest(samples: list[tuple[int, int, float]]) -> int | None:
    return max((length for _, length, _ in samples), default=None)


def _scaled(
    line: tuple[float, float], other_prior: tuple[float, float], other_fit: tuple[float, float]
) -> tuple[float, float]:
    """``line`` scaled term by term as ``other_prior`` became ``other_fit`` (by the larger
    factor where a term of the prior was zero)."""
    factors = [f / p for f, p in zip(other_fit, other_prior, strict=True) if p > 0]
    top = max(factors, default=1.0)
    return tuple(  # type: ignore[return-value]
        value * (f / p if p > 0 else top)
        for value, f, p in zip(line, other_fit, other_prior, strict=True)
    )


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
