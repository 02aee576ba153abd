"""How long a forward pass takes, learned from the batches that ran.

``seconds = a + b·n·L + c·n·L²`` for ``n`` items padded to ``L`` tokens: ``a`` is paid once
per pass (on a CPU, streaming every weight through memory: 4.5 ms for the bundled model on
our 2-core host, as much as 40 padded tokens), ``b`` per padded token, ``c`` the attention
term that grows with length. The planner weighs padding against an extra pass with it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np

# Subsets of the three terms tried by the non-negative fit, all three first.
_TERMS = [s for k in (3, 2, 1) for s in itertools.combinations(range(3), k)]


class BatchTimeModel:
    """Fitted to the last ``window`` batches by least squares on relative error (a 5 ms
    pass counts as much as a 500 ms one), with every coefficient kept non-negative.

    Refitted every ``refit_every`` batches, and no more often than every quarter of the
    samples held: with 256 of them a fit takes about 0.5 ms of the event loop, and a few new
    batches barely move it. (At one batch per request, every 8 batches was 60 us a request.)"""

    def __init__(self, *, window: int = 256, refit_every: int = 8, min_samples: int = 8) -> None:
        if min_samples < 3:
            raise ValueError(f"min_samples must be at least 3, got {min_samples}")
        self.min_samples = min_samples
        self.refit_every = refit_every
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._since_fit = refit_every  # the first fit as soon as there are min_samples
        self.coefficients: tuple[float, float, float] | None = None
        """``(a, b, c)`` in seconds; None until enough varied batches ran."""

    def observe(self, num_items: int, padded_len: int, seconds: float) -> None:
        if num_items < 1 or padded_len < 1 or seconds <= 0:
            return
        self._samples.append((num_items, padded_len, seconds))
        self._since_fit += 1
        # NOTE: also while unfitted, at most every refit_every batches: batches of one shape
        # (an idle server's) cannot be fitted, and each try costs an SVD on the event loop.
        due = max(self.refit_every, len(self._samples) // 4)
        if len(self._samples) >= self.min_samples and self._since_fit >= due:
            self._since_fit = 0
            self.coefficients = fit_time_model(self._samples) or self.coefficients

    def predict(self, num_items: int, padded_len: int) -> float:
        if self.coefficients is None:
            raise RuntimeError("the time model has not been fitted yet")
        return predict_seconds(self.coefficients, num_items, padded_len)


def predict_seconds(
    coefficients: tuple[float, float, float], num_items: int, padded_len: int
) -> float:
    a, b, c = coefficients
    tokens = num_items * padded_len
    return a + b * tokens + c * tokens * padded_len


def fit_time_model(
    samples: Sequence[tuple[int, int, float]],
) -> tuple[float, float, float] | None:
    """Non-negative least squares over ``(n, L, seconds)`` samples, by trying each subset of
    the terms (three terms: seven fits) and keeping the best one whose coefficients are all
    non-negative. None when the samples cannot tell the terms apart (all one shape)."""
    data = np.asarray(samples, dtype=float)
    tokens = data[:, 0] * data[:, 1]
    features = np.column_stack([np.ones(len(data)), tokens, tokens * data[:, 1]])
    design = features / data[:, 2:3]  # relative error: divide each row by its time
    target = np.ones(len(data))
    if np.linalg.matrix_rank(design) < 2:
        return None
    best: tuple[float, np.ndarray] | None = None
    for terms in _TERMS:
        columns = design[:, terms]
        # lstsq's own rank: one SVD per subset instead of two (this runs on the event loop).
        solution, _, rank, _ = np.linalg.lstsq(columns, target, rcond=None)
        if rank < len(terms) or (solution < 0).any():
            continue
        residual = float(np.sum((columns @ solution - target) ** 2))
        if best is None or residual < best[0] - 1e-12:
            coefficients = np.zeros(3)
            coefficients[list(terms)] = solution
            best = (residual, coefficients)
    if best is None or not best[1][:2].any():
        return None
    a, b, c = (float(x) for x in best[1])
    return a, b, c
