"""How long a step takes, and how many prompt tokens a step may prefill beside its decode
tokens.

``StepTimeModel`` fits ``a + b·tokens + c·attended + d·sampled`` to the steps that ran: ``a``
is what every step pays (on a CPU, reading the weights once), ``b`` each token fed, ``c``
each query-key pair attention computes (a chunk deep in a long prompt attends to everything
before it), ``d`` each row through the LM head (Gemma's is 262,144 words wide). It predicts
a decode step well (most steps are decode steps), a prompt chunk beside one less so: a token
of a 30-token chunk costs a CPU about twice what a token of a 256-token one does (a narrow
matrix product uses the cores less well), which a linear fit over both cannot hold.
``PrefillPacer`` therefore learns the cost of a prompt token beside decode tokens from the
steps that had both: what they took past the model's prediction for their decode tokens
alone, a token.
"""

from __future__ import annotations

import collections

import numpy as np

WINDOW = 256
"""Steps the fit reads (the latest)."""
MIN_STEPS = 8
REFIT_EVERY = 8
TERMS = 4


class StepTimeModel:
    def __init__(self) -> None:
        self._samples: collections.deque[tuple[int, int, int, float]] = collections.deque(
            maxlen=WINDOW
        )
        self._since_fit = 0
        self.coefficients: tuple[float, float, float, float] | None = None
        """``(a, b, c, d)`` once fitted."""

    def observe(self, num_tokens: int, attended: int, num_sampled: int, elapsed_s: float) -> None:
        self._samples.append((num_tokens, attended, num_sampled, elapsed_s))
        self._since_fit += 1
        if len(self._samples) >= MIN_STEPS and (
            self.coefficients is None or self._since_fit >= REFIT_EVERY
        ):
            self._fit()

    def predict(self, num_tokens: int, attended: int, num_sampled: int) -> float | None:
        if self.coefficients is None:
            return None
        a, b, c, d = self.coefficients
        return a + b * num_tokens + c * attended + d * num_sampled

    def token_cost(self, depth: int) -> float | None:
        """What one more prompt token costs a step, ``depth`` tokens into its prompt."""
        if self.coefficients is None:
            return None
        _, b, c, _ = self.coefficients
        return b + c * depth

    def _fit(self) -> None:
        self._since_fit = 0
        data = np.asarray(self._samples, dtype=float)
        columns = [np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]]
        times = data[:, 3]
        # A term that never varied apart from the others (every step a decode step: as many
        # tokens as sequences) cannot be told from them: the last such is left out.
        keep = list(range(TERMS))
        while len(keep) > 1 and _rank(columns, keep) < len(keep):
            keep.pop()
        # Drop a term that fits negative (too few distinct shapes yet) and fit again.
        while True:
            matrix = np.stack([columns[i] for i in keep], axis=1)
            solution, *_ = np.linalg.lstsq(matrix, times, rcond=None)
            negative = [k for k, value in zip(keep, solution, strict=True) if value < 0 and k]
            if not negative:
                break
            keep.remove(negative[0])
        fitted = dict.fromkeys(range(TERMS), 0.0)
        fitted.update(zip(keep, (max(0.0, float(v)) for v in solution), strict=True))
        if fitted[1] <= 0:  # no per-token cost seen yet: not a usable model
            return
        self.coefficients = (fitted[0], fitted[1], fitted[2], fitted[3])


class PrefillPacer:
    """How many prompt tokens a step beside decode tokens may take, so that its time stays
    within ``factor`` times the decode tokens' alone: the room, ``(factor - 1)`` times a step
    of those decode tokens alone, over what a prompt token beside them costs. Both are moving
    averages of the steps that ran: decode steps by their number of sequences, and what the
    steps with both took past their decode tokens' alone, a token (the time model's
    predictions until such steps have run)."""

    WEIGHT = 0.3
    """The latest step's weight in the averages."""

    def __init__(self, model: StepTimeModel) -> None:
        self._model = model
        self.token_cost_s: float | None = None
        self._alone_s: dict[int, float] = {}

    def alone(self, num_decode: int, attended: int) -> float | None:
        """A step of ``num_decode`` decode tokens (``attended`` query-key pairs) alone."""
        found = self._alone_s.get(num_decode)
        return found if found is not None else self._model.predict(num_decode, attended,
                                                                   num_decode)  # fmt: skip

    def observe_alone(self, num_decode: int, elapsed_s: float) -> None:
        last = self._alone_s.get(num_decode)
        self._alone_s[num_decode] = (
            elapsed_s if last is None else last + self.WEIGHT * (elapsed_s - last)
        )

    def observe(self, elapsed_s: float, alone_s: float, prefill_tokens: int) -> None:
        """A step that also prefilled ``prefill_tokens`` took ``elapsed_s``; its decode
        tokens alone take ``alone_s``."""
        if prefill_tokens <= 0:
            return
        cost = max(0.0, elapsed_s - alone_s) / prefill_tokens
        last = self.token_cost_s
        self.token_cost_s = cost if last is None else last + self.WEIGHT * (cost - last)

    def tokens(self, alone_s: float | None, factor: float, *, depth: int = 0) -> int | None:
        """Prompt tokens beside decode tokens that take ``alone_s`` alone (None: no figure
        yet)."""
        cost = self.token_cost_s if self.token_cost_s else self._model.token_cost(depth)
        if alone_s is None or not cost:
            return None
        return max(0, int((factor - 1.0) * alone_s / cost))


def _rank(columns: list[np.ndarray], keep: list[int]) -> int:
    return int(np.linalg.matrix_rank(np.stack([columns[i] for i in keep], axis=1)))


def attended(start: int, count: int, window: int | None = None) -> int:
    """Query-key pairs of ``count`` tokens fed after ``start`` cached ones (a causal chunk:
    each attends to everything before it and itself)."""
    pairs = count * start + count * (count + 1) // 2
    if window is not None:
        pairs = min(pairs, count * window)
    return pairs
