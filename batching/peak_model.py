"""The adaptive sizer's memory model: a forward pass's peak memory above what is in use
before it, as

    peak_bytes(n, L) = alpha * n * L + beta * n * L**2

(n items padded to L tokens: hidden states, Q/K/V and the feed-forward grow with n*L,
attention scores with n*L**2; what a batch's items share, a sliding window's token distances,
is the larger of it and ``shared_beta * L**2``). It starts from a prior derived from the
model's shape (``prior_peak_model``) and is corrected from measured peaks, as an upper
envelope rather than a mean (``fit_envelope``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .timing import fit_time_model


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
    sliding_window: int | None = None, gated_mlp: bool = False, token_logits: int = 0,
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
    window mask beside the full one). Flash kernels hold no ``L x L`` tensor. A head with
    ``token_logits`` values per token (a masked language model's vocabulary, for SPLADE)
    holds them and one copy.
    """
    e = element_bytes
    head_dim = head_dim or hidden_size // max(1, num_heads)
    kv_heads = num_kv_heads or num_heads
    attention_width = (num_heads + 2 * kv_heads) * head_dim
    alpha = e * (8 * hidden_size + attention_width + (3 if gated_mlp else 2) * intermediate_size)
    alpha += e * 2 * token_logits
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
        token_logits=getattr(shape, "token_logits", 0),  # a head's logits per token, if any
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
