"""How long a step takes: ``a + b·tokens + d·sequences``, fitted to the steps that ran.

``a`` is what every step pays (on a CPU, reading the weights once), ``b`` each token fed,
``d`` each sequence (its attention and its cache writes, layer by layer). The engine asks it
how many prompt tokens a step may prefill beside its decode tokens.
"""

from __future__ import annotations

import collections

import numpy as np

WINDOW = 256
"""Steps the fit reads (the latest)."""
MIN_STEPS = 8
REFIT_EVERY = 8


class StepTimeModel:
    def __init__(self) -> None:
        self._samples: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=WINDOW)
        self._since_fit = 0
        self.coefficients: tuple[float, float, float] | None = None
        """``(a, b, d)`` once fitted."""

    def observe(self, num_tokens: int, num_seqs: int, elapsed_s: float) -> None:
        self._samples.append((num_tokens, num_seqs, elapsed_s))
        self._since_fit += 1
        if len(self._samples) >= MIN_STEPS and (
            self.coefficients is None or self._since_fit >= REFIT_EVERY
        ):
            self._fit()

    def predict(self, num_tokens: int, num_seqs: int) -> float | None:
        if self.coefficients is None:
            return None
        a, b, d = self.coefficients
        return a + b * num_tokens + d * num_seqs

    def prefill_tokens(self, num_tokens: int, num_seqs: int, factor: float) -> int | None:
        """Prompt tokens a step of ``num_tokens`` decode tokens over ``num_seqs`` sequences
        may add while its predicted time stays within ``factor`` times its own (None: not
        fitted yet)."""
        alone = self.predict(num_tokens, num_seqs)
        if alone is None or self.coefficients is None:
            return None
        _, b, d = self.coefficients
        # One more sequence joins with them (its share of ``d``), then ``b`` a token.
        room = (factor - 1.0) * alone - d
        return max(0, int(room / b)) if b > 0 else None

    def _fit(self) -> None:
        self._since_fit = 0
        data = np.asarray(self._samples, dtype=float)
        tokens, seqs, times = data[:, 0], data[:, 1], data[:, 2]
        columns = [np.ones_like(tokens), tokens, seqs]
        # A term that never varied apart from the others (every step a decode step: as many
        # tokens as sequences) cannot be told from them: the last such is left out.
        keep = [0, 1, 2]
        while len(keep) > 1 and np.linalg.matrix_rank(
            np.stack([columns[i] for i in keep], 1)
        ) < len(keep):
            keep.pop()
        # Drop a term that fits negative (too few distinct shapes yet) and fit again.
        for _ in range(3):
            matrix = np.stack([columns[i] for i in keep], axis=1)
            solution, *_ = np.linalg.lstsq(matrix, times, rcond=None)
            negative = [k for k, value in zip(keep, solution, strict=True) if value < 0 and k]
            if not negative:
                break
            keep.remove(negative[0])
        if len(keep) == 1:
            return
        fitted = dict.fromkeys(range(3), 0.0)
        fitted.update(zip(keep, (max(0.0, float(v)) for v in solution), strict=True))
        if fitted[1] <= 0:  # no per-token cost seen yet: not a usable model
            return
        self.coefficients = (fitted[0], fitted[1], fitted[2])
